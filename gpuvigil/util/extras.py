"""Optional dependencies: imported only where used, with a one-line error naming the extra.

`pip install gpuvigil` is enough for `serve` (NVML/DCGM, logs, Slurm), the API and every output.
The Kubernetes adapter needs `gpuvigil[kubernetes]`; regenerating the Grafana dashboards needs
`gpuvigil[build]` (see docs/dependencies.md)."""

from __future__ import annotations

import importlib
from types import ModuleType

from gpuvigil.errors import UserError

# import name → (extra, distribution) for the optional dependencies.
EXTRAS = {
    "kubernetes": ("kubernetes", "kubernetes"),
    "grafanalib": ("build", "grafanalib"),
    "nats": ("fleet", "nats-py"),
}


class MissingExtra(UserError, ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str, what: str) -> ModuleType:
    """Import `module` (a module of an optional dependency) or raise MissingExtra naming the extra."""
    top = module.split(".", 1)[0]
    extra, dist = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".", 1)[0] != top:
            raise  # the package is there but something it needs is broken: show the real error
        raise MissingExtra(f"{what} needs {dist}, which is not installed: pip install 'gpuvigil[{extra}]'") from None
