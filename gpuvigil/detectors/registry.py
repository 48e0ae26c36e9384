"""The registered detectors: every class of `gpuvigil/detectors/` that declares a `spec`.

A detector registers by declaring itself (detectors/base.py: `Declared`, `DetectorSpec`); nothing
here names one. What follows from the declarations:

- `default_detectors(cfg)`: every registered detector, in the declared `order`, each built from
  its block of the `detectors` config section (app/compose.py picks each run mode's share of it);
- `config_models()`: that section's blocks and their models (config/__init__.py validates them);
- `placement()`: where each runs in the fleet (the node agent, a detect replica, the act leader);
- `every_seconds()`: how often each runs by default (`pipeline.detector_every_seconds`).

The observation level, capability and streams of each (pipeline/levels.py) and what the window
keeps for it (pipeline/core.py) are read off the instances, which carry their spec's values.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from gpuvigil.detectors.base import Declared, Detector, DetectorSpec, Placement

# Modules of the package that hold no detector (helpers, the level selection, this registry).
_NOT_DETECTORS = frozenset({"base", "common", "incremental", "levels", "per_gpu", "registry"})


@functools.cache
def registered() -> tuple[type[Declared], ...]:
    """Every declared detector class, in the declared order (then by name)."""
    import gpuvigil.detectors as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _NOT_DETECTORS:
            importlib.import_module(f"{package.__name__}.{info.name}")
    seen: dict[str, type[Declared]] = {}
    stack = list(Declared.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        spec = cls.__dict__.get("spec")
        if not isinstance(spec, DetectorSpec) or not cls.__module__.startswith(f"{package.__name__}."):
            continue
        if spec.name in seen and seen[spec.name] is not cls:
            raise RuntimeError(f"detector name {spec.name!r} is declared twice: {seen[spec.name].__qualname__} and {cls.__qualname__}")
        seen[spec.name] = cls
    return tuple(sorted(seen.values(), key=lambda c: (c.spec.order, c.spec.name)))


def specs() -> dict[str, DetectorSpec]:
    return {cls.spec.name: cls.spec for cls in registered()}


def config_models() -> dict[str, type[BaseModel]]:
    """The `detectors` config section's blocks: detector name -> its config model."""
    return {name: spec.config for name, spec in specs().items()}


def placement() -> dict[str, Placement]:
    return {name: spec.placement for name, spec in specs().items()}


def names_placed(where: Placement) -> list[str]:
    return [name for name, p in placement().items() if p == where]


def every_seconds() -> dict[str, float]:
    """Detector -> its declared run period (those that run every tick left out)."""
    return {name: spec.every_seconds for name, spec in specs().items() if spec.every_seconds}


def default_detectors(cfg: dict[str, Any] | None = None, only: Mapping[str, Any] | None = None) -> list[Detector]:
    """One instance of every registered detector (or of those named in `only`), built from `cfg`."""
    return [cls(cfg) for cls in registered() if only is None or cls.spec.name in only]  # type: ignore[call-arg]
