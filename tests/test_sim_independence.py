"""The simulator does not know the detectors: no module under gpuvigil/sim/ imports a detector,
a message parser, the detector/classifier configuration or a detector's constant, so the faults it
plays are shaped by published and captured behaviour (gpuvigil/sim/faults.py), not by what the
detectors test for. Checked on the source (ast), so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

SIM = Path(__file__).resolve().parent.parent / "gpuvigil" / "sim"
# What a simulator must not read: the detectors, the parsers/classifiers they share, the
# pipeline that runs them and the configuration files that hold their thresholds and templates.
FORBIDDEN_MODULES = ("gpuvigil.detectors", "gpuvigil.parsers", "gpuvigil.pipeline", "gpuvigil.collectors.nccl_log", "gpuvigil.offline.analyze")
FORBIDDEN_FILES = ("detectors.yaml", "oom_classify.yaml", "hints.yaml")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else "gpuvigil.sim." + node.module
            out += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__"):
            out += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def _sim_modules() -> list[Path]:
    return sorted(SIM.rglob("*.py"))


def test_there_is_a_simulator_to_check():
    assert {p.name for p in _sim_modules()} >= {"cluster.py", "faults.py", "scenario.py"}


@pytest.mark.parametrize("path", _sim_modules(), ids=lambda p: str(p.relative_to(SIM)))
def test_no_simulator_module_imports_a_detector(path):
    bad = [m for m in _imports(path) if m.startswith(FORBIDDEN_MODULES) or m == "gpuvigil.config"]
    assert bad == [], f"{path.name} imports {bad}: the simulator must not know the detectors"
    text = path.read_text()
    assert not [f for f in FORBIDDEN_FILES if f in text], f"{path.name} names a detector configuration file"


def test_the_check_catches_a_detector_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from gpuvigil.detectors.fragmentation_allocator import FragmentationAllocatorConfig\n")
    assert "gpuvigil.detectors.fragmentation_allocator.FragmentationAllocatorConfig" in _imports(bad)


# -- the fault models' own shapes -------------------------------------------------------------------


def test_allocator_rounding_follows_pytorch():
    from gpuvigil.sim import faults

    assert faults.round_request(1) == 512 and faults.round_request(513) == 1024
    assert faults.segment_size(1000) == 2 << 20  # small pool: 2 MiB segments
    assert faults.segment_size(5 << 20) == 20 << 20  # < 10 MiB: a 20 MiB segment
    assert faults.segment_size((10 << 20) + 1) == 12 << 20  # larger: rounded up to 2 MiB
    free = np.array([1 << 30, 1 << 30, 30 << 20])
    cached = np.array([4 << 30, 0, 0])
    # Retried only when nothing cached fits and the device has no room for the segment.
    assert faults.needs_retry(2 << 30, cached, free).tolist() == [False, True, True]


@pytest.mark.parametrize("wording", [w for w, _ in __import__("gpuvigil.sim.faults", fromlist=["x"]).OOM_WORDINGS])
def test_every_oom_wording_is_a_cuda_oom(wording):
    from gpuvigil.sim import faults

    rng = np.random.default_rng(0)
    _, text = faults.oom_message(rng, request=4 << 30, capacity=139.8 * (1 << 30), process_in_use=136 << 30, allocated=130 << 30,
                                 unallocated=5 << 30, foreign=0.0, rank=3, wording=wording, split=True)
    assert "out of memory" in text
    if wording.startswith("torch_"):
        assert "Tried to allocate 4.00 GiB" in text.replace("\n", " ") and "\n" in text


def test_hang_shapes_vary_and_keep_the_culprit_behind():
    from gpuvigil.sim import faults

    rng = np.random.default_rng(1)
    shapes = set()
    for _ in range(200):
        shape = faults.draw_hang_shape(rng, 16, [5])
        enq, comp, ops = faults.hang_progress(shape, 16, 100, [5])
        shapes.add(shape["shape"])
        assert (comp == 100).all() and (enq[np.arange(16) != 5] >= 101).all()
        assert enq[5] == (101 if shape["shape"] == "in_kernel" else 100)
        assert ops[5] == (shape["op"] if shape["shape"] == "in_kernel" else None)
    assert shapes == {"missing", "p2p", "in_kernel"}
