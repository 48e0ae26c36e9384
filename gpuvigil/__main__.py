import sys

from gpuvigil.cli import main

sys.exit(main())
