"""One composition root (gpuvigil/app/compose.py) for every run mode: each mode runs exactly the
detectors whose declarations place them in its stages, its sinks come in the documented order,
and no mode assembles a pipeline or a detector list of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from gpuvigil import config
from gpuvigil.app import compose
from gpuvigil.cli.main import build_parser
from gpuvigil.collectors.fr_dumps import FrDumpTrigger
from gpuvigil.config.deploy import Fleet
from gpuvigil.detectors.registry import registered

ROOT = Path(__file__).resolve().parents[1]
EVERY_STAGE = {"agent", "detect", "act"}
# role -> the fleet stages whose detectors it runs (the single-process modes run them all).
STAGES = {"serve": EVERY_STAGE, "replay": EVERY_STAGE, "analyze": EVERY_STAGE | {"offline"}, "agent": {"agent"}, "detect": {"detect"}, "act": {"act"}}


def declared(role: str, moved_to_agent: set[str] | None = None) -> list[str]:
    """What the declarations say `role` runs (DetectorSpec.placement, read off each class)."""
    out = []
    for cls in registered():
        where = cls.spec.placement
        if moved_to_agent is not None:  # fleet.agent_detectors: exactly these in the agent
            where = "agent" if cls.spec.name in moved_to_agent else where if where in ("act", "offline") else "detect"
        if where in STAGES[role]:
            out.append(cls.spec.name)
    return out


@pytest.mark.parametrize("role", sorted(STAGES))
def test_each_role_runs_the_detectors_its_declarations_place_there(role):
    cfg = config.defaults()
    assert [d.name for d in compose.detectors(cfg, role, fleet=Fleet())] == declared(role)
    moved = {"xid", "hang_device"}
    assert [d.name for d in compose.detectors(cfg, role, fleet=Fleet(agent_detectors=sorted(moved)))] == declared(role, moved)


def test_the_fleet_runs_each_detector_once_and_every_one_serve_runs():
    for fleet in (Fleet(), Fleet(agent_detectors=["xid", "hang_device", "straggler"])):
        split = [compose.detector_names(role, fleet) for role in ("agent", "detect", "act")]
        names = [n for part in split for n in part]
        assert sorted(names) == sorted(compose.detector_names("serve")) and len(names) == len(set(names))
    with pytest.raises(Exception, match="fleet.agent_detectors: unknown detector"):
        compose.detector_names("agent", Fleet(agent_detectors=["xid", "thermo"]))
    with pytest.raises(ValueError, match="unknown role"):
        compose.detector_names("report")


def test_offline_detectors_run_in_analyze_only_and_cannot_be_moved_to_the_agent():
    offline = [cls.spec.name for cls in registered() if cls.spec.placement == "offline"]
    for role in compose.ROLES:
        names = set(compose.detector_names(role))
        assert (set(offline) <= names) if role == "analyze" else not (set(offline) & names), role
    for name in offline:
        with pytest.raises(Exception, match="read after the fact"):
            compose.detector_names("agent", Fleet(agent_detectors=[name]))


class Named:
    def __init__(self, name: str):
        self.name = name

    def on_tick(self, result, window) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class FrSource:
    kind = "flight_recorder"

    def __init__(self) -> None:
        self.sink = Named("fr_trigger")


@pytest.mark.parametrize("role, expected", [
    ("serve", ["scheduler", "stats", "alerts", "store", "probe", "fr_trigger", "acting"]),
    ("agent", ["scheduler", "stats", "alerts", "store", "probe", "acting"]),  # its trigger answers detect's requests
    ("detect", ["scheduler", "stats", "alerts", "store", "probe", "FrDumpTrigger", "acting"]),
    ("act", ["scheduler", "stats", "alerts", "store", "probe", "acting"]),
    ("replay", ["scheduler", "stats", "alerts", "store", "probe", "acting"]),
])
def test_sinks_come_in_the_documented_order(role, expected):
    outputs = compose.Outputs(stats=Named("stats"), alerts=Named("alerts"), store=Named("store"), acting=Named("acting"), extra=[Named("probe")])
    got = compose.sinks(role, outputs, scheduler=Named("scheduler"), sources=[FrSource()], dump_ask=lambda job: True)
    assert [type(s).__name__ if isinstance(s, FrDumpTrigger) else s.name for s in got] == expected
    assert compose.SINK_ORDER == ("scheduler", "stats", "alerts", "store", "extra", "sources", "acting")


def test_the_agent_s_flight_recorder_trigger_answers_requests_instead_of_deciding(tmp_path):
    src = FrSource()
    assert compose.dump_asker("agent", [src]) is src.sink
    assert compose.dump_asker("serve", [src]) is None  # serve's trigger decides, as a sink


def _calls(tree: ast.AST, name: str) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if called == name:
                out.append(node.lineno)
    return out


def test_no_mode_assembles_its_own_pipeline_or_detector_list():
    """Only the root calls Pipeline(...) and default_detectors(...); each mode calls the root."""
    own = {}
    for path in sorted((ROOT / "gpuvigil").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in ("gpuvigil/app/compose.py", "gpuvigil/detectors/registry.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in ("Pipeline", "default_detectors"):
            for line in _calls(tree, name):
                own[f"{rel}:{line}"] = name
    assert own == {}
    modes = {
        "gpuvigil/app/runtime.py": "build", "gpuvigil/app/serve.py": "build", "gpuvigil/fleet/agent.py": "build",
        "gpuvigil/fleet/detect.py": "build", "gpuvigil/fleet/act.py": "build", "gpuvigil/offline/replay.py": "build",
        "gpuvigil/offline/analyze.py": "detect_once", "gpuvigil/offline/fr.py": "detect_once",
    }
    for rel, fn in modes.items():
        assert _calls(ast.parse((ROOT / rel).read_text(encoding="utf-8")), fn), f"{rel} does not call compose.{fn}"


def test_each_mode_s_pipeline_is_the_root_s(tmp_path, monkeypatch):
    """The pipelines the modes really build: serve (simulated and real, with a Flight Recorder
    folder), a simulated agent, a real agent with a Flight Recorder folder, a detect partition,
    act, replay and analyze."""
    from gpuvigil.app.runtime import build_simulated
    from gpuvigil.app.serve import Server
    from gpuvigil.fleet import act as act_mod
    from gpuvigil.fleet import agent as agent_mod
    from gpuvigil.fleet import detect as detect_mod
    from gpuvigil.offline import analyze, replay
    from gpuvigil.scheduler.core import Scheduler

    def names(pipeline) -> list[str]:
        return [d.name for d in pipeline.detectors]

    def parse(*argv: str):
        return build_parser(list(argv)).parse_args(list(argv))

    assert names(build_simulated("healthy").pipeline) == declared("serve")

    server = Server(parse("serve", "--port", "0", "--fr-dump-dir", str(tmp_path / "fr"), "--node", "gvx", "--outbox", str(tmp_path / "o.sqlite")))
    server.start()
    try:
        pipe = server.runtime.pipeline
        assert names(pipe) == declared("serve")
        assert [type(s).__name__ for s in pipe.sinks] == ["Scheduler", "TickStats", "FrDumpTrigger"]
        assert isinstance(pipe.sinks[0], Scheduler)
        (fr,) = server.sources  # its `up` is its collector's health in this pipeline, logged under its name
        assert fr.health is pipe.health and pipe.health.labels[fr.collector.name] == ("source flight_recorder", str(tmp_path / "fr"))
    finally:
        server.close()

    sim = agent_mod.Agent(parse("agent", "--scenario", "healthy", "--nodes", "2", "--port", "-1"))
    assert [names(a.pipeline) for a in sim.agents] == [declared("agent")] * 2 and sim.dump_askers == {}
    sim.close()

    (tmp_path / "agent.yaml").write_text(yaml.safe_dump({"sources": {"node": "gvx", "flight_recorder": str(tmp_path / "fr2")}}))
    real = agent_mod.Agent(parse("agent", "--config", str(tmp_path / "agent.yaml"), "--port", "-1"))
    try:
        (node_agent,) = real.agents
        assert names(node_agent.pipeline) == declared("agent")
        # The source's trigger writes the pipes detect asks for; it decides nothing in the agent.
        assert isinstance(real.dump_askers["gvx"], FrDumpTrigger)
        assert not any(isinstance(s, FrDumpTrigger) for s in node_agent.pipeline.sinks)
    finally:
        real.close()

    d = detect_mod.Detect(parse("detect", "--id", "d1"))
    pipe, _feed = d._pipeline()
    assert names(pipe) == declared("detect")
    assert [type(s).__name__ for s in pipe.sinks] == ["FrDumpTrigger"]

    a = act_mod.Act(parse("act", "--id", "a1", "--outbox", str(tmp_path / "act-outbox.sqlite")))
    assert names(a.pipeline) == ["fleet_relay", *declared("act")]

    built: list[tuple[str, list[str]]] = []
    real_build = compose.build

    def spy(cfg, role, collectors, **kw):
        p = real_build(cfg, role, collectors, **kw)
        built.append((role, names(p)))
        return p

    monkeypatch.setattr(compose, "build", spy)
    replay.run_replay(replay.Recorded(), start=0.0, end=1.0)
    assert built == [("replay", declared("replay"))]
    assert analyze.detect_once(["xid", "thermal", "hang_device"], {}, 1.0, None) == []
    monkeypatch.setattr(compose, "detectors", lambda cfg, role, **kw: built.append((role, sorted(kw["only"]))) or [])
    analyze.detect_once(["xid", "thermal"], {}, 1.0, None)
    assert built[-1] == ("analyze", ["thermal", "xid"])
