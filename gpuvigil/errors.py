"""Errors a user can fix: the CLI prints them as one line and exits 2, without a traceback."""


class UserError(Exception):
    """Bad input (arguments, scenario files, config, unreadable files)."""
