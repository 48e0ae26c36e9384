"""The in-process hook imports only the standard library, on every path it can take.

Each case runs in a fresh interpreter (a module loaded by an earlier test would hide a leak).
The Flight Recorder paths use a stand-in `torch` module whose `_distributed_c10d` dump functions
return real dumps captured on an H200 (tests/data/h200): a real torch would itself load numpy, and
what is tested here is what the hook loads. The real-torch path (gloo ranks, torch's own dumps)
is covered by test_instrument.py::test_real_gloo_ranks_publish_a_hung_collective.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "h200"
FORBIDDEN = ("polars", "numpy", "pydantic", "sklearn", "yaml", "pandas")

# step() publishes once (its interval has passed), then twice more and once at stop (a collective in flight across two publishes is fetched with its entries), then
# prints the records and the forbidden modules present.
PROBE = """
import json, sys, types
from pathlib import Path
mode, data_path, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
forbidden = sys.argv[4:]
if mode != "no-torch":
    blob = Path(data_path).read_bytes()
    def dump(includeCollectives=True, includeStackTraces=True, onlyActive=False):
        return blob
    c10d = types.SimpleNamespace(**{mode: dump})
    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    torch = types.ModuleType("torch")
    torch.distributed, torch._C, torch.cuda = dist, types.SimpleNamespace(_distributed_c10d=c10d), None
    sys.modules["torch"] = torch
else:
    sys.modules["torch"] = None
import gpuvigil.hook.instrument as gv
clock = iter(range(1000)).__next__
hook = gv.Hook("job", gv.FileSink(out_dir), rank=0, node="n0", gpu=0, interval=1.0, clock=lambda: float(clock()))
hook.step(); hook.publish(); hook.publish(); hook.stop()
records = [json.loads(line) for line in (Path(out_dir) / "job.rank0.jsonl").read_text().splitlines()]
print(json.dumps({"errors": hook.errors, "last_error": hook.last_error, "records": records,
                  "loaded": [m for m in forbidden if m in sys.modules]}))
"""


def _run(mode: str, data: Path | None, tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(data or ""), str(tmp_path), *FORBIDDEN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    ("mode", "data", "want"),
    [
        # torch >= 2.5: the JSON dump (a real one, nothing in flight).
        ("_dump_fr_trace_json", DATA / "s5_fr_dump.json", {"last_enqueued": 44, "last_started": -1, "last_completed": 44, "current_op": None}),
        # Older torch: the pickle dump, read with the hook's no-globals unpickler. A real hung
        # all_reduce (#6 enqueued, #5 completed): the second publish names the stuck op.
        ("_dump_fr_trace", DATA / "s6_fr_rank_0", {"last_enqueued": 6, "last_started": -1, "last_completed": 5, "current_op": "all_reduce"}),
        ("_dump_nccl_trace", DATA / "s6_fr_rank_0", {"last_enqueued": 6, "last_started": -1, "last_completed": 5, "current_op": "all_reduce"}),
        ("no-torch", None, None),
    ],
)
def test_the_hook_loads_only_the_standard_library(tmp_path, mode, data, want):
    out = _run(mode, data, tmp_path)
    assert out["loaded"] == [], f"the hook loaded {out['loaded']}"
    assert out["errors"] == 0, out["last_error"]
    last = out["records"][-1]
    if want is None:
        assert "pg_status" not in last
    else:
        assert last["pg_status"] == {"0": want}


def test_a_pickle_dump_naming_a_global_is_refused_not_run(tmp_path):
    # A pickle that would call os.system when loaded: the hook's unpickler refuses the global, the
    # publish fails (counted), and training goes on.
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    out = _run("_dump_fr_trace", evil, tmp_path)
    assert out["loaded"] == []
    assert out["records"] == [] and out["errors"] == 4 and "os.system refused" in out["last_error"]


def test_bench_hook_measures_the_import():
    from benchmarks import hook as bench

    res = bench.bench_import(runs=1)
    assert res["module"] == "gpuvigil.hook.instrument" and res["heavy_modules_loaded"] == []
    assert res["median_ms"] > 0 and res["median_rss_added_mb"] >= 0
    text = bench.markdown({"python": "3", "torch": None, "step_call_ns": 100.0, "import": res, "end_to_end": {"steps": 1, "without_s": 1.0, "with_s": 1.0, "publishes": 0, "overhead_pct": 0.0},
                           "modelled_overhead_pct_p50": 0.01, "modelled_overhead_pct_p99": 0.1})
    # The targets table judges the import: its wall time, memory, and the heavy modules (none).
    assert "| `import gpuvigil.hook.instrument`, wall (median) | < 50 ms |" in text
    assert "| heavy modules loaded by the import | none | none | met |" in text
