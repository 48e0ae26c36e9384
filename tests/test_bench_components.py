"""`gpuvigil bench components`, reduced to 20 days of the InfiniteHBD trace and one component fault
of each kind: the section it writes states where its data came from and computes every target,
and the component faults are named with fewer node drains than node by node."""

from __future__ import annotations

from benchmarks import components
from benchmarks.report import write_section


def test_reduced_run_names_components_and_writes_its_section(tmp_path):
    r = components.run(days=20, per_type=1, seed=3, tick=30.0, nodes=256, scale=1.0)
    assert r["injected"] == 4 and r["background_findings"] > 0
    assert r["found"] >= 3 and r["precision"] >= 0.75
    # the named components' one action replaced most per-node drains on their nodes
    assert r["node_actions_with"] < r["node_actions_baseline"] / 2 and r["component_actions"] >= 3
    # background node faults are still drained: held, never dropped
    assert r["background_actions_with"] == r["background_actions_baseline"]
    assert all(t >= 0 for t in r["time_to_name_s"])
    text = components.markdown(r, "gpuvigil bench components --days 20 --per-type 1 --seed 3")
    assert "findings-level simulation" in text and "pipeline ticks of 30 s" in text and "InfiniteHBD" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.rstrip().endswith(("| met |", "| not met |", "| not measured |"))]
    assert len(rows) == len(components.targets(r)) == 6
    doc = write_section("components", text, tmp_path / "benchmarks.md")
    assert "<!-- bench:components:start -->" in doc.read_text()
