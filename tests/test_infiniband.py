"""InfiniBand/RoCE ports from sysfs (collectors/infiniband.py) and their detector
(detectors/infiniband.py), on trees that mirror a real machine's layout.

Source: tests/data/sysfs/ (see its README): the file names, formats ("4: ACTIVE", "5: LinkUp",
"400 Gb/sec (4X NDR)") and counters of the kernel's Documentation/ABI/stable/sysfs-class-infiniband
and the mlx5 driver's hw_counters, laid out as on a node with two GPUs and two NDR HCAs, each pair
behind its own PCIe switch, and one RoCE NIC. Each test copies the tree and moves its counters and
states between reads, as a live link does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil import config, schemas
from gpuvigil.collectors.infiniband import InfinibandCollector, normalize_bdf, parse_counter, parse_rate, parse_state
from gpuvigil.detectors.infiniband import InfinibandDetector
from gpuvigil.window import Window

import sysfs_trees

TREE = sysfs_trees.tree("two_gpu_ndr")
GPUS = {"00000000:18:00.0": 0, "00000000:9D:00.0": 1}  # NVML's PCI bus ids of the tree's GPUs


@pytest.fixture
def sysfs(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(TREE, root, symlinks=True)
    return root


def port_dir(root: Path, device: str, port: int = 1) -> Path:
    return root / "class" / "infiniband" / device / "ports" / str(port)


def put(root: Path, device: str, name: str, value: str, port: int = 1) -> None:
    (port_dir(root, device, port) / name).write_text(value + "\n")


def bump(root: Path, device: str, counter: str, by: int, port: int = 1) -> None:
    p = port_dir(root, device, port) / "counters" / counter
    if not p.exists():
        p = port_dir(root, device, port) / "hw_counters" / counter
    p.write_text(f"{int(p.read_text()) + by}\n")


# -- parsers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("400 Gb/sec (4X NDR)\n", (400.0, 4, "NDR")),
        ("200 Gb/sec (4X HDR)", (200.0, 4, "HDR")),
        ("100 Gb/sec (2X HDR)", (100.0, 2, "HDR")),
        ("2.5 Gb/sec (1X SDR)", (2.5, 1, "SDR")),
        ("25 Gb/sec", (25.0, None, None)),  # some RoCE drivers print no width
        ("fast", (None, None, None)),
        ("", (None, None, None)),
    ],
)
def test_rate(text, want):
    assert parse_rate(text) == want


# What the kernel writes (drivers/infiniband/core/sysfs.c, state_show and phys_state_show: "%d: %s\n").
KERNEL_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
KERNEL_PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp", 6: "LinkErrorRecovery", 7: "Phy Test"}


@pytest.mark.parametrize(("code", "name"), [*KERNEL_STATES.items(), *KERNEL_PHYS_STATES.items()])
def test_every_state_the_kernel_writes_reads_as_its_name(code, name):
    assert parse_state(f"{code}: {name}\n") == name
    assert parse_state(name) == name


@pytest.mark.parametrize(
    ("text", "want"),
    [("4: ACTIVE\n", "ACTIVE"), ("  7 :  Phy Test  \n", "Phy Test"), ("4:", None), ("", None), ("\n", None), ("0: <unknown>\n", None),
     ("4: ACTIVE!", None), ("7: Phy  Test", None), ("7: Phy Test:", None), ("x: ACTIVE", None), ("4: 4", None), ("4: ACTIVE\n5: LinkUp", None)],
)
def test_state_edges(text, want):
    assert parse_state(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [("0\n", 0), ("18446744073709551615\n", None), ("9223372036854775807", 9223372036854775807), ("-1", None), ("12 ", 12), ("0x10", None), ("١٢", None)],
)
def test_counter(text, want):
    assert parse_counter(text) == want


def test_bdf():
    assert normalize_bdf("00000000:9D:00.0") == "0000:9d:00.0"
    assert normalize_bdf("0000:18:00.0") == "0000:18:00.0"
    assert normalize_bdf("pci0000:15") is None
    assert normalize_bdf("1ffff:18:00.0") is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64), st.sampled_from(["state", "phys_state", "rate", "link_layer", "counters/symbol_error", "hw_counters/out_of_buffer"]))
def test_garbage_files_become_nulls_never_errors(sysfs, data, name):
    """Any bytes in any file: the port is still read, the bad value is null (or what it says)."""
    (port_dir(sysfs, "mlx5_0") / name).write_bytes(data)
    df = InfinibandCollector(sysfs, node="n0").read(1.0)
    assert df.schema == schemas.IB_PORTS
    assert df.height == 3
    row = df.filter(pl.col("device") == "mlx5_0").row(0, named=True)
    text = data.decode("utf-8", errors="replace")
    if name == "rate":
        assert (row["rate_gbps"], row["width"], row["speed"]) == parse_rate(text)
    elif name == "counters/symbol_error":
        assert row["symbol_error"] == parse_counter(text)


def test_oversized_and_unreadable_files(sysfs):
    put(sysfs, "mlx5_0", "state", "4: ACTIVE" + " " * 5000)
    (port_dir(sysfs, "mlx5_1") / "counters" / "symbol_error").unlink()
    (port_dir(sysfs, "mlx5_1") / "counters" / "symbol_error").mkdir()
    c = InfinibandCollector(sysfs, node="n0")
    df = c.read(1.0)
    assert df.filter(pl.col("device") == "mlx5_0")["state"].to_list() == [None]
    assert df.filter(pl.col("device") == "mlx5_1")["symbol_error"].to_list() == [None]
    assert c.errors >= 1


# -- the collector on the tree -----------------------------------------------------------------------


def test_reads_every_port_with_its_gpu_affinity():
    df = InfinibandCollector(TREE, node="n0", pci_to_gpu=GPUS).read(100.0)
    got = df.select("device", "port", "link_layer", "state", "phys_state", "rate_gbps", "width", "speed", "pci_bus_id", "numa_node", "gpus", "affinity").rows()
    assert got == [
        ("mlx5_0", 1, "InfiniBand", "ACTIVE", "LinkUp", 400.0, 4, "NDR", "0000:19:00.0", 0, [0], "pcie"),  # same PCIe switch as GPU 0
        ("mlx5_1", 1, "InfiniBand", "ACTIVE", "LinkUp", 400.0, 4, "NDR", "0000:9e:00.0", 1, [1], "pcie"),
        ("mlx5_2", 1, "Ethernet", "ACTIVE", "LinkUp", 200.0, 4, "HDR", "0000:a1:00.0", 1, [1], "numa"),  # only its NUMA node is shared
    ]
    assert df["link_downed"].to_list() == [1, 1, 1]
    assert df["port_xmit_wait"].to_list() == [1873] * 3
    assert df["out_of_buffer"].to_list() == [0] * 3  # from hw_counters/


def test_without_gpus_ports_are_node_level_and_no_tree_is_a_row_saying_so(tmp_path):
    df = InfinibandCollector(TREE, node="n0").read(1.0)
    assert df["affinity"].to_list() == ["node"] * 3 and df["gpus"].to_list() == [[]] * 3
    c = InfinibandCollector(tmp_path, node="n9")
    [row] = c.read(5.0).to_dicts()
    assert (row["node"], row["device"], row["port"], row["ts"]) == ("n9", None, None, 5.0)
    assert c.health() == {str(tmp_path / "class" / "infiniband"): None}  # no RDMA here: not a failing collector


# -- the detector -------------------------------------------------------------------------------------


def run(root: Path, steps, *, cfg: dict | None = None, dt: float = 30.0, alloc: pl.DataFrame | None = None):
    """Read the tree every `dt` seconds; before read i, steps[i](root) changes it. Findings per read."""
    coll = InfinibandCollector(root, node="n0", pci_to_gpu=GPUS)
    det = InfinibandDetector(config.load(overrides={"detectors": {"infiniband": cfg or {}}}) if cfg else None)
    w = Window(1e9)
    if alloc is not None:
        w.add("allocations", alloc)
    out = []
    for i, step in enumerate(steps):
        if step is not None:
            step(root)
        now = 1000.0 + i * dt
        for stream, df in coll.collect(now).items():
            w.add(stream, df)
        w.seal(now)
        out.append(det.detect(w))
    return out


ALLOC = schemas.frame([{"job": "train-7", "rank": 0, "node": "n0", "gpu": 0}, {"job": "eval-2", "rank": 0, "node": "n0", "gpu": 1}], schemas.ALLOCATIONS)


def kinds(findings):
    return sorted((f.kind.value, f.evidence.get("device")) for f in findings)


def test_healthy_tree_with_steady_counters_says_nothing(sysfs):
    def traffic(root):  # data moves, errors do not
        bump(root, "mlx5_0", "port_xmit_data", 10**9)
        bump(root, "mlx5_0", "port_xmit_wait", 500)

    assert run(sysfs, [None] + [traffic] * 10) == [[]] * 11


def test_a_port_leaving_active_is_down_and_pages_with_its_gpu_and_job(sysfs):
    def down(root):
        put(root, "mlx5_0", "state", "1: DOWN")
        put(root, "mlx5_0", "phys_state", "2: Polling")
        bump(root, "mlx5_0", "link_downed", 1)

    out = run(sysfs, [None, None, down, None], alloc=ALLOC)
    assert out[:2] == [[], []]
    [f] = out[2]
    assert (f.kind.value, f.severity.value, f.node, f.gpu, f.job, f.cause) == ("ib_link_down", "page", "n0", 0, "train-7", "hardware")
    assert f.evidence["device"] == "mlx5_0" and f.evidence["port"] == 1 and f.evidence["state"] == "DOWN" and f.evidence["phys_state"] == "Polling"
    assert f.evidence["affinity"] == "pcie" and f.evidence["jobs"] == ["train-7"] and f.evidence["flapping"] is False
    assert "InfiniBand link down on n0 mlx5_0 port 1" in f.summary and "train-7" in f.summary
    assert [g.id for g in out[3]] == [f.id]  # still down: the same finding


def test_link_downed_rising_while_up_is_a_drop_then_flapping(sysfs):
    """Each drop lasts less than a read interval: only the counter sees it."""
    flap = lambda root: bump(root, "mlx5_1", "link_downed", 1)  # noqa: E731
    out = run(sysfs, [None, flap, None, flap, None], alloc=ALLOC)
    assert out[0] == []  # the boot's link_downed 1 is history, not a drop seen
    [one] = out[1]
    assert (one.kind.value, one.severity.value, one.gpu, one.job) == ("ib_link_down", "ticket", 1, "eval-2")
    assert one.evidence["flapping"] is True and one.evidence["events_in_window"] == 1 and "dropped" in one.summary
    [f] = out[3]
    assert f.id == one.id and f.evidence["events_in_window"] == 2 and f.evidence["link_downed"] == 3
    assert "flapping" in f.summary and "down 2 times" in f.summary
    assert len(out[4]) == 1  # both drops still within 600 s


def test_flaps_age_out_of_the_window(sysfs):
    flap = lambda root: bump(root, "mlx5_1", "link_downed", 1)  # noqa: E731
    out = run(sysfs, [None, flap, flap, None, None], cfg={"flap_window_seconds": 45.0, "flap_min_events": 2})
    assert [len(x) for x in out] == [0, 0, 1, 0, 0]
    out = run(sysfs, [None, flap, None, None, None], cfg={"flap_window_seconds": 45.0})
    assert [len(x) for x in out] == [0, 1, 1, 0, 0]


def test_an_error_burst_is_reported_before_the_window_ends(sysfs):
    """1000 symbol errors within 30 s: over the 60 s window's allowance (10/min x 1 min) already."""

    def burst(root):
        bump(root, "mlx5_0", "symbol_error", 1000)

    out = run(sysfs, [None, burst])
    [f] = out[1]
    assert f.kind.value == "ib_link_errors" and f.evidence["window_seconds"] == 30.0 and f.evidence["symbol_error"] == 1000
    assert json.loads(f.evidence["errors_per_minute"])["symbol_error"] == 2000.0


def test_never_active_port_is_not_down_unless_expected(sysfs):
    """A dual-port HCA's second port without a cable: DOWN, Polling, from the start."""
    p2 = port_dir(sysfs, "mlx5_1", 2)
    shutil.copytree(port_dir(sysfs, "mlx5_1", 1), p2)
    put(sysfs, "mlx5_1", "state", "1: DOWN", port=2)
    put(sysfs, "mlx5_1", "phys_state", "2: Polling", port=2)
    assert run(sysfs, [None, None]) == [[], []]
    out = run(sysfs, [None, None], cfg={"expected_ports": 4})
    assert kinds(out[1]) == [("ib_link_down", "mlx5_1")]
    assert out[1][0].evidence["port"] == 2


def test_half_width_against_peers_and_against_config(sysfs):
    """Two IB ports: a 1-to-1 split has no majority, so peers alone say nothing; a third port at
    400 Gb/s (mlx5_0's second port) makes 400 the node's rate."""

    def half(root):
        put(root, "mlx5_1", "rate", "200 Gb/sec (2X NDR)")

    assert run(sysfs, [None, half]) == [[], []]
    shutil.copytree(port_dir(sysfs, "mlx5_0", 1), port_dir(sysfs, "mlx5_0", 2))
    put(sysfs, "mlx5_1", "rate", "400 Gb/sec (4X NDR)")
    out = run(sysfs, [None, half])
    assert out[0] == []
    [f] = out[1]
    assert (f.kind.value, f.severity.value, f.evidence["device"]) == ("ib_link_degraded", "ticket", "mlx5_1")
    assert (f.evidence["rate_gbps"], f.evidence["width"], f.evidence["expected_rate_gbps"], f.evidence["expected_width"], f.evidence["expected_from"]) == (200.0, 2, 400.0, 4, "peers")
    assert "200 Gb/s at 2X where 400 Gb/s at 4X is expected (its peers on the node)" in f.summary
    # The configured rate needs no peers; the RoCE NIC (200 Gb/s) is not matched by the pattern.
    shutil.rmtree(port_dir(sysfs, "mlx5_0", 2))
    [[f]] = run(sysfs, [None], cfg={"expected": {"mlx5_[01]": {"rate_gbps": 400, "width": 4}}})
    assert (f.kind.value, f.evidence["device"], f.evidence["expected_from"]) == ("ib_link_degraded", "mlx5_1", "config")


def test_error_rates_over_the_window(sysfs):
    """symbol_error +6 per 30 s read = 12/min on mlx5_0 (limit 10); mlx5_1 +2 per read (4/min)."""

    def errors(root):
        bump(root, "mlx5_0", "symbol_error", 6)
        bump(root, "mlx5_1", "symbol_error", 2)

    out = run(sysfs, [None, errors, errors, errors, errors])
    assert out[:2] == [[], []]  # the first rate needs 60 s
    [f] = out[2]
    assert (f.kind.value, f.severity.value, f.evidence["device"], f.evidence["over"]) == ("ib_link_errors", "ticket", "mlx5_0", ["symbol_error"])
    assert f.evidence["window_seconds"] == 60.0 and f.evidence["symbol_error"] == 12
    assert "symbol_error 12/min (limit 10)" in f.summary
    assert [g.id for g in out[3]] == [f.id]  # the verdict holds until the next evaluation
    assert [g.id for g in out[4]] == [f.id]


def test_counter_reset_is_a_new_baseline_not_an_error(sysfs):
    def big(root):
        (port_dir(root, "mlx5_0") / "counters" / "symbol_error").write_text("5000\n")

    def reset(root):
        (port_dir(root, "mlx5_0") / "counters" / "symbol_error").write_text("0\n")

    out = run(sysfs, [big, None, None, reset, None, None, None])
    assert out == [[]] * 7


def test_a_port_gone_is_missing_and_so_is_a_short_count(sysfs):
    def gone(root):
        (root / "class" / "infiniband" / "mlx5_1").unlink()

    out = run(sysfs, [None, gone, None], alloc=ALLOC)
    assert out[0] == []
    [f] = out[1]
    assert (f.kind.value, f.severity.value, f.node, f.evidence["lost"], f.evidence["ports_present"]) == ("ib_port_missing", "page", "n0", ["mlx5_1/1"], 2)
    assert f.evidence["jobs"] == ["eval-2", "train-7"] and f.job is None
    assert [g.id for g in out[2]] == [f.id]
    [[g]] = run(sysfs, [None], cfg={"expected_ports": 3})  # a fresh start: only the count knows
    assert g.evidence["ports_present"] == 2 and g.evidence["lost"] == []


def test_every_port_gone_is_still_a_read(sysfs):
    def all_gone(root):
        shutil.rmtree(root / "class" / "infiniband")

    out = run(sysfs, [None, all_gone])
    [f] = out[1]
    assert f.kind.value == "ib_port_missing" and f.evidence["ports_present"] == 0 and len(f.evidence["lost"]) == 3


def test_excluded_devices_and_layers_are_not_watched(sysfs):
    def down(root):
        put(root, "mlx5_2", "state", "1: DOWN")

    assert kinds(run(sysfs, [None, down])[1]) == [("ib_link_down", "mlx5_2")]
    assert run(sysfs, [None, down], cfg={"exclude_devices": ["mlx5_2"]})[1] == []
    assert run(sysfs, [None, down], cfg={"link_layers": ["InfiniBand"]})[1] == []


def test_each_port_is_its_own_finding(sysfs):
    def both(root):
        put(root, "mlx5_0", "state", "1: DOWN")
        put(root, "mlx5_1", "state", "1: DOWN")

    [a, b] = run(sysfs, [None, both])[1]
    assert a.id != b.id and {a.evidence["device"], b.evidence["device"]} == {"mlx5_0", "mlx5_1"}


def test_unknown_error_counter_is_refused():
    with pytest.raises(Exception, match="symbol_eror"):
        InfinibandDetector(config.load(overrides={"detectors": {"infiniband": {"error_rates_per_minute": {"symbol_eror": 1}}}}))


# -- metrics -------------------------------------------------------------------------------------------


def test_exported_port_series(sysfs):
    """The exporter's families for the newest read of each node's ports."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from gpuvigil.exporter.metrics import Snapshot
    from gpuvigil.exporter.prometheus import _render

    coll = InfinibandCollector(sysfs, node="n0", pci_to_gpu=GPUS)
    w = Window(1e9)
    w.add("ib_ports", coll.read(10.0))
    w.seal(10.0)
    put(sysfs, "mlx5_1", "state", "1: DOWN")
    bump(sysfs, "mlx5_0", "symbol_error", 7)
    (sysfs / "class" / "infiniband" / "mlx5_2").unlink()
    w.add("ib_ports", coll.read(20.0))
    w.seal(20.0)
    fams = Snapshot(SimpleNamespace(pipeline=SimpleNamespace(window=w)))._ib_families()
    samples = {(s.name, s.labels.get("device")): (s.value, s.labels) for f in text_string_to_metric_families(_render(fams).decode()) for s in f.samples}
    assert samples[("gpuvigil_ib_port_up", "mlx5_0")][0] == 1 and samples[("gpuvigil_ib_port_up", "mlx5_1")][0] == 0
    assert ("gpuvigil_ib_port_up", "mlx5_2") not in samples  # gone since the newest read
    assert samples[("gpuvigil_ib_ports", None)] == (2, {"node": "n0"})
    assert samples[("gpuvigil_ib_port_symbol_errors_total", "mlx5_0")] == (7, {"node": "n0", "device": "mlx5_0", "port": "1", "link_layer": "InfiniBand"})
    assert samples[("gpuvigil_ib_port_rate_bytes_per_second", "mlx5_1")][0] == 5e10  # 400 Gb/s
    assert samples[("gpuvigil_ib_port_out_of_buffer_total", "mlx5_0")][0] == 0  # from hw_counters/
    assert samples[("gpuvigil_ib_port_info", "mlx5_0")][1] == {"node": "n0", "device": "mlx5_0", "port": "1", "link_layer": "InfiniBand",
                                                               "pci_bus_id": "0000:19:00.0", "affinity": "pcie", "gpus": "0"}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_parsers_never_raise_and_agree_with_the_kernel_format(text):
    rate, width, speed = parse_rate(text)
    assert rate is None or rate >= 0
    if rate is not None and width is not None:
        assert parse_rate(f"{rate:g} Gb/sec ({width}X {speed or ''})")[:2] == (rate, width)
    state = parse_state(text)
    assert state is None or (state.replace("_", "").replace(" ", "").isalpha() and state == " ".join(state.split()))
    value = parse_counter(text)
    assert value is None or 0 <= value < 1 << 63


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("utf-8", errors="replace")),
                 st.builds("{}: {}".format, st.integers(-9, 99), st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ abcxyz_:<>\t\n", max_size=30))))
def test_parse_state_never_raises_on_garbage(text):
    state = parse_state(text)
    assert state is None or (state and state == state.strip() and state in text)


@pytest.mark.parametrize(
    ("phys", "meaning"),
    [("2: Polling", "no link: the port polls for a peer"), ("7: Phy Test", "in physical test mode: not in service"), ("3: Disabled", "disabled by software")],
)
def test_a_port_that_left_active_names_its_physical_state(sysfs, phys, meaning):
    """A port that was ACTIVE and now polls for a peer has no link; one put in physical test mode
    is out of service: both are down, and the summary says which (not "unreadable")."""

    def down(root):
        put(root, "mlx5_0", "state", "1: DOWN")
        put(root, "mlx5_0", "phys_state", phys)

    coll_errors = InfinibandCollector(sysfs, node="n0")
    out = run(sysfs, [None, down], alloc=ALLOC)
    [f] = out[1]
    name = phys.split(": ", 1)[1]
    assert (f.kind.value, f.severity.value, f.evidence["state"], f.evidence["phys_state"]) == ("ib_link_down", "page", "DOWN", name)
    assert f"physical {name} ({meaning}" in f.summary and "; it was ACTIVE)" in f.summary and "unreadable" not in f.summary
    coll_errors.read(1.0)
    assert coll_errors.errors == 0  # a state the kernel writes is not a read error


def test_a_port_s_finding_is_the_port_s_whichever_job_it_serves(sysfs):
    """Identity is node/device/port (evidence port_id): a new job on the GPU behind the port does
    not make the same down port a new finding, alert and hint."""

    def down(root):
        put(root, "mlx5_0", "state", "1: DOWN")

    other = schemas.frame([{"job": "train-8", "rank": 0, "node": "n0", "gpu": 0}], schemas.ALLOCATIONS)
    [[a]] = run(sysfs, [None, down], alloc=ALLOC)[1:]
    shutil.rmtree(sysfs)
    shutil.copytree(TREE, sysfs, symlinks=True)
    [[b]] = run(sysfs, [None, down], alloc=other)[1:]
    assert (a.job, b.job) == ("train-7", "train-8") and a.id == b.id and a.evidence["port_id"] == "n0/mlx5_0/1"
