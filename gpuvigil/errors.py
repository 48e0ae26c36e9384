"""Errors a user can fix, and the argparse flavour that reports them: the CLI prints them as one line
and exits 2, without a traceback.

This sits below every package so that command modules (alerts, dashboards, bench, api...) raise
and build their parsers without importing `gpuvigil.cli.main`; only `cli.main` formats."""

from __future__ import annotations

import argparse


class UserError(Exception):
    """Bad input (arguments, scenario files, config, unreadable files)."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")
