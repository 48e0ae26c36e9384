"""The command line: argument parsing only; nothing else imports this package."""
