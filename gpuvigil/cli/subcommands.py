"""Lazy subcommand selection, shared by `cli` and commands with nested lazy subcommands (`bench`):
only the chosen command's module is imported. Lives outside `cli` so nothing imports `cli`."""

from __future__ import annotations

from collections.abc import Sequence

# What `cli.build_parser` was given, for nested lazy subcommands. Mutated in place (never rebound)
# so a module that imported the name sees the current argv.
CURRENT_ARGV: list[str] = []


def selected_command(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The first positional argument, if it names a command."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in names else None
    return None
