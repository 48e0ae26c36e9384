"""The import graph of `gpuvigil/` follows docs/architecture.md: each stage depends only on what it
should, so the pipeline can be split into separate deployables (agent / detect / act).

The graph is read with `ast` from the source (no import is executed): every `import` and
`from ... import` anywhere in a module (top level, inside functions, under `if TYPE_CHECKING`),
relative imports resolved, `from pkg import sub` counted as an edge to the submodule `pkg.sub`,
and `importlib.import_module("literal")` / `__import__("literal")` calls counted too.

The rules are a table (`FORBIDDEN`, `ALLOWED_ONLY`, `SCHEDULER_LAYERS`); `test_checker_catches_*`
plants each kind of bad edge in a scratch tree and proves the checker reports it, so the checks
on the real tree cannot pass vacuously.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gpuvigil"

# (importer prefix, forbidden target prefix, why). A prefix matches the module and its submodules.
FORBIDDEN: list[tuple[str, str, str]] = [
    ("gpuvigil.detectors", "gpuvigil.collectors", "detectors see frames and events, never sources"),
    ("gpuvigil.detectors", "gpuvigil.scheduler", "detectors do not know who acts on findings"),
    ("gpuvigil.detectors", "gpuvigil.alerts", "detectors do not know the outputs"),
    ("gpuvigil.detectors", "gpuvigil.api", "detectors do not know the outputs"),
    ("gpuvigil.collectors", "gpuvigil.detectors", "collectors only read the world"),
    ("gpuvigil.collectors", "gpuvigil.scheduler", "collectors only read the world"),
    ("gpuvigil.collectors", "gpuvigil.pipeline", "collectors only read the world"),
    ("gpuvigil.collectors", "gpuvigil.sim", "the simulated world is handed to its collector, not imported"),
    ("gpuvigil.scheduler", "gpuvigil.detectors", "the scheduler knows hints, not detectors"),
    ("gpuvigil.scheduler", "gpuvigil.api", "the scheduler's mechanism does not live in the API"),
    ("gpuvigil.dashboards", "gpuvigil.alerts", "builders do not depend on each other"),
    ("gpuvigil", "gpuvigil.cli", "nothing imports the command line; commands raise UserError, cli formats"),
    ("gpuvigil.detectors", "gpuvigil.fleet", "detectors do not know the transport (same code in serve and the fleet)"),
    ("gpuvigil.pipeline", "gpuvigil.fleet", "the pipeline does not know the transport"),
    ("gpuvigil.collectors", "gpuvigil.fleet", "collectors only read the world"),
    ("gpuvigil.alerts", "gpuvigil.fleet", "outputs do not know the transport"),
    ("gpuvigil.api", "gpuvigil.fleet", "outputs do not know the transport"),
    ("gpuvigil.scheduler", "gpuvigil.fleet", "the scheduler knows hints, not the transport"),
]
# `python -m gpuvigil` is the one entry point that runs the command line.
CLI_ENTRY_POINTS = {"gpuvigil.__main__", "gpuvigil.cli"}

# (importer prefix, what it may import besides the standard library, why).
ALLOWED_ONLY: list[tuple[str, tuple[str, ...], str]] = [
    ("gpuvigil.schemas", ("polars", "pydantic", "gpuvigil.schemas", "gpuvigil.signals", "gpuvigil.model"), "the data contract sits below everything"),
    ("gpuvigil.signals", ("polars",), "the table of telemetry columns the schema is built from sits below it"),
    ("gpuvigil.model", ("polars", "pydantic", "gpuvigil.schemas", "gpuvigil.model", "gpuvigil.kinds"), "the data contract sits below everything"),
    ("gpuvigil.kinds", (), "the table of finding kinds the data contract is built from sits below it"),
    (
        "gpuvigil.parsers",
        ("pydantic", "gpuvigil.parsers", "gpuvigil.config", "gpuvigil.model", "gpuvigil.schemas", "gpuvigil.errors"),
        "pure text parsing shared by collectors, detectors and analyze: no sources, no I/O stacks",
    ),
    ("gpuvigil.errors", (), "the CLI-error helpers sit below every command module"),
]

# The scheduler, bottom to top; a module may import its own layer or those below, never above.
SCHEDULER_LAYERS: list[str] = [
    "gpuvigil.scheduler.state",  # specs, live state, actions taken (types)
    "gpuvigil.scheduler.framework",  # session, cluster view, statement, plugin Protocols
    "gpuvigil.scheduler.plugins",  # policy plugins and their registry
    "gpuvigil.scheduler.actions",  # enqueue, allocate, preempt, backfill
    "gpuvigil.scheduler.core",  # the Scheduler loop
]


# Each package's layer, bottom to top (docs/architecture.md): a module imports its own layer or
# those below, never above. A package not named here fails test_every_package_has_a_layer.
LAYERS: list[tuple[str, ...]] = [
    ("gpuvigil.errors", "gpuvigil.signals", "gpuvigil.kinds", "gpuvigil.gpu", "gpuvigil.hook"),  # vocabulary, tables, the stdlib hook
    ("gpuvigil.schemas", "gpuvigil.util", "gpuvigil.config"),  # frame schemas, helpers, config models
    ("gpuvigil.model", "gpuvigil.window"),  # findings and hints, the window detectors read
    ("gpuvigil.parsers", "gpuvigil.exporter", "gpuvigil.policies"),  # pure text parsing, metric families, shared policies
    ("gpuvigil.collectors", "gpuvigil.detectors", "gpuvigil.scheduler", "gpuvigil.alerts", "gpuvigil.dashboards"),  # stages
    ("gpuvigil.pipeline", "gpuvigil.api", "gpuvigil.sim", "gpuvigil.preflight", "gpuvigil.deploy"),  # what composes stages
    ("gpuvigil.offline", "gpuvigil.app"),  # whole processes: saved files, serve
    ("gpuvigil.fleet",),  # the same processes split over NATS
    ("gpuvigil.cli", "gpuvigil.__main__"),  # the command line, imported by nothing
]
# Import cycles between files: none. The offline commands share their file reading through
# offline/formats.py, which imports none of them.
KNOWN_CYCLES: list[list[str]] = []


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    lazy: bool = False  # inside a function body

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} (line {self.line})"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def read_graph(root: Path, package: str = PACKAGE) -> tuple[set[str], list[Edge]]:
    """(modules, import edges) of `root/package`, read with `ast`."""
    files = sorted((root / package).rglob("*.py"))
    modules = {_module_name(root, f) for f in files}
    edges: list[Edge] = []
    for path in files:
        src = _module_name(root, path)
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f)}
        for node in ast.walk(tree):
            lazy = id(node) in in_function
            if isinstance(node, ast.Import):
                edges.extend(Edge(src, alias.name, node.lineno, lazy) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = src.split(".") if is_pkg else src.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                # `from pkg import sub, name`: an edge to each submodule, and to pkg for the rest.
                if len(subs) < len(node.names):
                    edges.append(Edge(src, target, node.lineno, lazy))
                edges.extend(Edge(src, s, node.lineno, lazy) for s in subs)
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                if name in ("import_module", "__import__"):
                    edges.append(Edge(src, node.args[0].value, node.lineno, lazy))
    return modules, edges


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names


def forbidden_edges(edges: list[Edge], src_prefix: str, dst_prefix: str) -> list[Edge]:
    return [
        e
        for e in edges
        if _under(e.src, src_prefix)
        and _under(e.dst, dst_prefix)
        and not _under(e.src, dst_prefix)  # a package's own modules may import each other
        and not (dst_prefix == "gpuvigil.cli" and e.src in CLI_ENTRY_POINTS)
    ]


def disallowed_edges(edges: list[Edge], src_prefix: str, allowed: tuple[str, ...]) -> list[Edge]:
    return [e for e in edges if _under(e.src, src_prefix) and not _stdlib(e.dst) and not any(_under(e.dst, a) for a in allowed)]


def _layer(module: str) -> int | None:
    for i, prefix in enumerate(SCHEDULER_LAYERS):
        if _under(module, prefix):
            return i
    return None


def upward_edges(edges: list[Edge]) -> list[Edge]:
    out = []
    for e in edges:
        a, b = _layer(e.src), _layer(e.dst)
        if a is not None and b is not None and b > a:
            out.append(e)
    return out


def cycles(edges: list[Edge], prefix: str) -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-import) under `prefix`."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if _under(e.src, prefix) and _under(e.dst, prefix) and e.dst != prefix:
            graph.setdefault(e.src, set()).add(e.dst)
            graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the scheduler graph is a few dozen nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(root: Path, package: str = PACKAGE) -> list[str]:
    """Every broken rule in the tree at `root`, one line each."""
    _modules, edges = read_graph(root, package)
    out = [f"{e}: {why}" for src, dst, why in FORBIDDEN for e in forbidden_edges(edges, src, dst)]
    out += [f"{e}: {why}" for src, allowed, why in ALLOWED_ONLY for e in disallowed_edges(edges, src, allowed)]
    out += [f"{e}: upward edge in the scheduler layers" for e in upward_edges(edges)]
    out += [f"import cycle in the scheduler: {' <-> '.join(c)}" for c in cycles(edges, "gpuvigil.scheduler")]
    return out


# -- the real tree ---------------------------------------------------------------------------

_MODULES, _EDGES = read_graph(ROOT)


def test_graph_is_read():
    """The reader sees the tree's real imports, including function-local ones."""
    assert len(_MODULES) > 60
    assert any(e.src == "gpuvigil.__main__" and _under(e.dst, "gpuvigil.cli") for e in _EDGES)
    assert any(e.src == "gpuvigil.app.runtime" and e.dst == "gpuvigil.collectors.simulated" for e in _EDGES)
    # Commands import their heavy dependencies inside functions: those edges count too.
    assert sum(e.lazy for e in _EDGES) > 10
    for layer in SCHEDULER_LAYERS:
        assert any(_under(m, layer) for m in _MODULES), f"scheduler layer {layer} is gone: update SCHEDULER_LAYERS and docs/architecture.md"


@pytest.mark.parametrize(("src", "dst", "why"), FORBIDDEN, ids=[f"{s}-x->{d}" for s, d, _ in FORBIDDEN])
def test_forbidden_edge(src, dst, why):
    bad = forbidden_edges(_EDGES, src, dst)
    assert not bad, f"{why}:\n" + "\n".join(map(str, bad))


@pytest.mark.parametrize(("src", "allowed", "why"), ALLOWED_ONLY, ids=[s for s, _, _ in ALLOWED_ONLY])
def test_allowed_dependencies_only(src, allowed, why):
    assert any(_under(m, src) for m in _MODULES), f"{src} is gone: update ALLOWED_ONLY"
    bad = disallowed_edges(_EDGES, src, allowed)
    assert not bad, f"{why}:\n" + "\n".join(map(str, bad))


def test_scheduler_layers_point_down():
    bad = upward_edges(_EDGES)
    assert not bad, "scheduler layers are state <- framework <- plugins <- actions <- core:\n" + "\n".join(map(str, bad))


def test_no_import_cycle_in_scheduler():
    assert cycles(_EDGES, "gpuvigil.scheduler") == []


def _package_layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(_under(module, p) for p in prefixes):
            return i
    return None


def test_every_package_has_a_layer():
    rooms = {".".join(m.split(".")[:2]) for m in _MODULES if m != PACKAGE}
    assert sorted(r for r in rooms if _package_layer(r) is None) == []


def layer_violations(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if e.dst.startswith(PACKAGE + ".") and (_package_layer(e.dst) or 0) > (_package_layer(e.src) or 0)]


def test_layer_checker_catches_an_upward_edge(tmp_path):
    _m, edges = read_graph(_tree(tmp_path, {"gpuvigil/model.py": "def f():\n    from gpuvigil.collectors import nccl_log\n"}))
    assert [str(e) for e in layer_violations(edges)] == ["gpuvigil.model -> gpuvigil.collectors.nccl_log (line 2)"]
    _m, edges = read_graph(_tree(tmp_path / "cycle", {"gpuvigil/detectors/a.py": "from gpuvigil.detectors import b\n", "gpuvigil/detectors/b.py": "import gpuvigil.detectors.a\n"}))
    assert cycles([e for e in edges if e.dst in _m], PACKAGE) == [["gpuvigil.detectors.a", "gpuvigil.detectors.b"]]


def test_package_layers_point_down():
    bad = layer_violations(_EDGES)
    assert not bad, "a lower layer imports a higher one:\n" + "\n".join(f"{e} (layer {_package_layer(e.src)} -> {_package_layer(e.dst)})" for e in bad)


def test_no_import_cycle_between_files():
    """No two files import each other, directly or through others."""
    found = cycles([e for e in _EDGES if e.dst in _MODULES], PACKAGE)
    assert found == KNOWN_CYCLES


# -- the checker catches planted bad edges ---------------------------------------------------

_CLEAN = {
    "gpuvigil/__init__.py": "",
    "gpuvigil/__main__.py": "from gpuvigil.cli import main\n",
    "gpuvigil/cli/main.py": "import importlib\nfrom gpuvigil.errors import UserError\n",
    "gpuvigil/errors.py": "import argparse\n",
    "gpuvigil/schemas.py": "import polars as pl\n",
    "gpuvigil/model.py": "from pydantic import BaseModel\nfrom gpuvigil import schemas\n",
    "gpuvigil/parsers/__init__.py": "",
    "gpuvigil/parsers/oom.py": "import re\nfrom gpuvigil.model import FindingKind\n",
    "gpuvigil/collectors/__init__.py": "",
    "gpuvigil/collectors/nccl_log.py": "from gpuvigil.parsers.oom import parse_oom\n",
    "gpuvigil/detectors/__init__.py": "",
    "gpuvigil/detectors/oom_events.py": "from gpuvigil.parsers import oom\n",
    "gpuvigil/scheduler/__init__.py": "from gpuvigil.scheduler.core import Scheduler\n",
    "gpuvigil/scheduler/state.py": "",
    "gpuvigil/scheduler/framework.py": "from gpuvigil.scheduler.state import JobState\n",
    "gpuvigil/scheduler/plugins/__init__.py": "from gpuvigil.scheduler.framework import Session\n",
    "gpuvigil/scheduler/actions.py": "from gpuvigil.scheduler.framework import Session\n",
    "gpuvigil/scheduler/core.py": "from gpuvigil.scheduler import actions\nfrom gpuvigil.scheduler.plugins import build\n",
}

# (name, files to add or replace -> their text, text a violation must contain)
_PLANTED = [
    (
        "detector imports a collector lazily",
        {"gpuvigil/detectors/oom_events.py": "def f():\n    from gpuvigil.collectors.nccl_log import parse_oom\n"},
        "gpuvigil.detectors.oom_events -> gpuvigil.collectors.nccl_log",
    ),
    (
        "relative import resolved",
        {"gpuvigil/detectors/oom_events.py": "from ..collectors import nccl_log\n"},
        "gpuvigil.detectors.oom_events -> gpuvigil.collectors.nccl_log",
    ),
    ("collector imports the scheduler", {"gpuvigil/collectors/sim.py": "import gpuvigil.scheduler.core\n"}, "gpuvigil.collectors.sim -> gpuvigil.scheduler.core"),
    ("collector imports the simulated world", {"gpuvigil/collectors/sim.py": "from gpuvigil.sim import world\n"}, "gpuvigil.collectors.sim -> gpuvigil.sim"),
    ("builder imports the cli", {"gpuvigil/alerts/build.py": "from gpuvigil.cli import OneLineErrorParser\n"}, "gpuvigil.alerts.build -> gpuvigil.cli"),
    ("cli imported by name", {"gpuvigil/bench.py": "import importlib\nimportlib.import_module('gpuvigil.cli')\n"}, "gpuvigil.bench -> gpuvigil.cli"),
    ("dashboards import alerts", {"gpuvigil/dashboards/build.py": "from gpuvigil.alerts.build import write_or_check\n"}, "gpuvigil.dashboards.build -> gpuvigil.alerts.build"),
    ("scheduler imports the api", {"gpuvigil/scheduler/slurm.py": "from gpuvigil.api.apply import HintApplier\n"}, "gpuvigil.scheduler.slurm -> gpuvigil.api.apply"),
    ("scheduler imports a detector", {"gpuvigil/scheduler/core.py": "import gpuvigil.detectors.oom_events\n"}, "gpuvigil.scheduler.core -> gpuvigil.detectors.oom_events"),
    ("model imports numpy", {"gpuvigil/model.py": "import numpy as np\n"}, "gpuvigil.model -> numpy"),
    ("schemas imports a stage", {"gpuvigil/schemas.py": "from gpuvigil import pipeline\n"}, "gpuvigil.schemas -> gpuvigil"),
    ("parser imports a collector", {"gpuvigil/parsers/oom.py": "from gpuvigil.collectors import nccl_log\n"}, "gpuvigil.parsers.oom -> gpuvigil.collectors.nccl_log"),
    (
        "framework imports core under TYPE_CHECKING",
        {"gpuvigil/scheduler/framework.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuvigil.scheduler.core import Scheduler\n"},
        "gpuvigil.scheduler.framework -> gpuvigil.scheduler.core (line 3): upward edge",
    ),
    (
        "plugin imports actions lazily",
        {"gpuvigil/scheduler/plugins/health.py": "def f():\n    from gpuvigil.scheduler.actions import find_plan\n"},
        "gpuvigil.scheduler.plugins.health -> gpuvigil.scheduler.actions (line 2): upward edge",
    ),
    (
        "cycle between scheduler modules",
        {"gpuvigil/scheduler/slurm.py": "from gpuvigil.scheduler import kubernetes\n", "gpuvigil/scheduler/kubernetes.py": "from gpuvigil.scheduler import slurm\n"},
        "import cycle in the scheduler: gpuvigil.scheduler.kubernetes <-> gpuvigil.scheduler.slurm",
    ),
]


def _tree(tmp_path: Path, extra: dict[str, str]) -> Path:
    files = {**_CLEAN, **extra}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in {p.parent for p in tmp_path.rglob("*.py")}:
        (d / "__init__.py").touch()
    return tmp_path


def test_checker_passes_a_clean_tree(tmp_path):
    assert violations(_tree(tmp_path, {})) == []


@pytest.mark.parametrize(("name", "files", "expected"), _PLANTED, ids=[p[0] for p in _PLANTED])
def test_checker_catches_planted_edge(tmp_path, name, files, expected):
    found = violations(_tree(tmp_path, files))
    assert any(expected in v for v in found), f"{name}: expected a violation containing {expected!r}, got {found}"
