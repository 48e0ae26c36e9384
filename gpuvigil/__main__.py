import sys

from gpuvigil.cli.main import main

sys.exit(main())
