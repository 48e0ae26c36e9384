"""The registered detectors: every class of `gpuvigil/detectors/` that declares a `spec`.

A detector registers by declaring itself (detectors/base.py: `Declared`, `DetectorSpec`); nothing
here names one. What follows from the declarations:

- `default_detectors(cfg)`: every registered detector, in the declared `order`, each built from
  its block of the `detectors` config section (app/compose.py picks each run mode's share of it);
- `config_models()`: that section's blocks and their models (config/__init__.py validates them);
- `placement()`: where each runs in the fleet (the node agent, a detect replica, the act leader);
- `every_seconds()`: how often each runs by default (`pipeline.detector_every_seconds`);
- `validate()`: that every declaration a detector needs is made (its spec, its kinds' policy
  rows, its hint rules, its config block, the schema and exported series of the columns it
  reads); `serve` runs it at start and the tests run it on the shipped files.

The observation level, capability and streams of each (pipeline/levels.py) and what the window
keeps for it (pipeline/core.py) are read off the instances, which carry their spec's values.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from gpuvigil.detectors.base import LIVE_PLACEMENTS, Declared, Detector, DetectorSpec, Placement

# Modules of the package that hold no detector (helpers, the level selection, this registry).
_NOT_DETECTORS = frozenset({"base", "common", "incremental", "levels", "per_gpu", "registry"})


def _modules(skip: frozenset[str] = _NOT_DETECTORS) -> list[Any]:
    import gpuvigil.detectors as package

    return [importlib.import_module(f"{package.__name__}.{info.name}") for info in pkgutil.iter_modules(package.__path__) if info.name not in skip]


@functools.cache
def registered() -> tuple[type[Declared], ...]:
    """Every declared detector class, in the declared order (then by name)."""
    return scan()


def scan() -> tuple[type[Declared], ...]:
    """`registered()` read afresh (the classes as they are now, not as first imported)."""
    import gpuvigil.detectors as package

    _modules()
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


def specs(classes: tuple[type[Declared], ...] | None = None) -> dict[str, DetectorSpec]:
    return {cls.spec.name: cls.spec for cls in (registered() if classes is None else classes)}


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
    """One instance of every registered detector a live pipeline runs (or of those named in
    `only`), built from `cfg`; the offline ones (placed `offline`) are analyze's alone."""
    return [cls(cfg) for cls in registered() if cls.spec.placement in LIVE_PLACEMENTS and (only is None or cls.spec.name in only)]  # type: ignore[call-arg]


# Columns a detector declares it reads that gpuvigil does not re-export on /metrics, and why.
# Replaying gpuvigil's own series (offline/replay.py) cannot fill them.
NOT_EXPORTED: Mapping[str, str] = {}


class DeclarationError(RuntimeError):
    """A detector misses a declaration the product needs (the message names each)."""


def undeclared() -> list[str]:
    """Classes of the package that have `detect()` but no spec: they would never run."""
    known = set(scan())
    out = []
    for module in _modules(skip=frozenset({"base"})):  # the Protocol itself
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and callable(getattr(cls, "detect", None)) and not cls.__name__.startswith("_") and cls not in known:
                out.append(f"{module.__name__}.{cls.__qualname__}")
    return sorted(out)


def omissions(defaults: Mapping[str, Any] | None = None, runbooks: str | None = None) -> list[str]:
    """Every missing or inconsistent declaration, one sentence each naming the detector and what it
    lacks. `defaults`: the shipped config sections (config.defaults()); `runbooks`: the text of
    docs/runbooks.md, whose anchors are checked when given."""
    from gpuvigil import config

    defaults = config.defaults() if defaults is None else defaults
    out = [f"{qualname} has detect() but no `spec = DetectorSpec(...)`: it is not registered and never runs" for qualname in undeclared()]
    declared = specs(scan())
    blocks = defaults.get("detectors") or {}
    ruled = {str(r.get("kind")) for r in (defaults.get("hints") or {}).get("rules") or [] if isinstance(r, Mapping)}
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', runbooks)) if runbooks is not None else None
    for name, spec in declared.items():
        out += _kind_omissions(name, spec, ruled, anchors)
        out += _config_omissions(name, spec, blocks.get(name))
        out += _column_omissions(name, spec)
    out += [f"detectors.{name} in gpuvigil/config/detectors.yaml configures no registered detector" for name in blocks if name not in declared]
    return out


def _kind_omissions(name: str, spec: DetectorSpec, ruled: set[str], anchors: set[str] | None) -> list[str]:
    from gpuvigil import kinds

    out = []
    for kind in spec.emits:
        if kind not in kinds.POLICIES:
            out.append(f"{name} emits {kind.value}, which has no row in POLICIES (gpuvigil/kinds.py): no scope, identity or owner to route its alerts to")
        elif anchors is not None and kinds.runbook_anchor(kind) not in anchors:
            out.append(f"{name} emits {kind.value}, whose runbook section (anchor {kinds.runbook_anchor(kind)!r}) is missing from docs/runbooks.md")
        if kind.value not in ruled:
            out.append(f"{name} emits {kind.value} with no rule in gpuvigil/config/hints.yaml (an empty `actions: []` says none, on purpose)")
    return out


def _config_omissions(name: str, spec: DetectorSpec, block: Any) -> list[str]:
    if block is None:
        return [f"{name} has no block in gpuvigil/config/detectors.yaml (its values are {spec.config.__name__}'s defaults)"]
    try:
        given = spec.config.model_validate(block).model_dump()
    except ValueError as exc:
        return [f"{name}: its block in gpuvigil/config/detectors.yaml is not a valid {spec.config.__name__}: {exc}"]
    default = spec.config().model_dump()
    return [
        f"{name}: gpuvigil/config/detectors.yaml gives {key} = {given[key]!r}, {spec.config.__name__}'s default is {default[key]!r}"
        for key in default
        if given[key] != default[key]
    ]


def _column_omissions(name: str, spec: DetectorSpec) -> list[str]:
    from gpuvigil import schemas, signals

    out = []
    for stream, reads in spec.reads.items():
        if stream not in schemas.STREAMS:
            out.append(f"{name} reads stream {stream!r}, which has no schema in gpuvigil/schemas.py")
            continue
        for column in reads.columns or ():
            if column not in schemas.STREAMS[stream]:
                where = "a Signal row in gpuvigil/signals.py" if stream == "gpu_samples" else "a column in gpuvigil/schemas.py"
                out.append(f"{name} reads {stream}.{column}, which the schema lacks (it needs {where})")
            elif stream == "gpu_samples" and column in signals.BY_NAME and column not in {k.name for k in signals.GPU_KEY}:
                if not signals.BY_NAME[column].prometheus and column not in NOT_EXPORTED:
                    out.append(f"{name} reads gpu_samples.{column}, which has no exported series (`prometheus` of its Signal row in gpuvigil/signals.py)")
    return out


def validate(defaults: Mapping[str, Any] | None = None, runbooks: str | None = None) -> None:
    """Raise DeclarationError naming every declaration a detector misses (see `omissions`)."""
    missing = omissions(defaults, runbooks)
    if missing:
        raise DeclarationError("detector declarations incomplete:\n- " + "\n- ".join(missing))
