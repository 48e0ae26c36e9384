"""NVLink link state, the NVLink fabric (Fabric Manager / IMEX) and pending memory repairs: read
through NVML (a fake pynvml) and dcgm-exporter (exposition text), and the detectors over them
(detectors/nvlink_fabric.py, detectors/memory_repair.py).

Sources: the NVML fake is tests/test_nvml.py's, extended with `nvmlDeviceGetNvLinkState` and
`nvmlDeviceGetGpuFabricInfo`; a real H200 answered NotSupported for all 18 NVLink indexes
(tests/data/h200/nvml_inventory.json, `nvlink`), the PCIe case. The fabric states and their
mapping onto DCGM's dcgmFabricManagerStatus_t (0 not supported .. 4 failure) are those of DCGM's
own cache-manager tests (NVIDIA/DCGM). The dcgm-exporter text follows the labels of
tests/data/dcgm/node07_constructed.prom, with the opt-in fields DCGM_FI_DEV_FABRIC_MANAGER_STATUS
(170), DCGM_FI_DEV_ROW_REMAP_PENDING (396) and DCGM_FI_DEV_RETIRED_PENDING (392) of dcgm_fields.h.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from gpuvigil import config, schemas
from gpuvigil.collectors import dcgm
from gpuvigil.collectors.nvml import NvmlCollector
from gpuvigil.detectors.memory_repair import MemoryRepairDetector
from gpuvigil.detectors.nvlink_fabric import NvlinkFabricDetector
from gpuvigil.window import Window
from test_nvml import FakeNvml, h200

INVENTORY = json.loads((Path(__file__).parent / "data" / "h200" / "nvml_inventory.json").read_text())
NS, INVALID = pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT


class FabricNvml(FakeNvml):
    """FakeNvml with per-link NVLink state and the GPU's fabric info. A GPU's `nvlink` is its
    links' states (1 enabled, 0 disabled) or "pcie" (NotSupported for every index, as the real
    H200); `fabric` is (state, status) or an NVML error code."""

    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_ERROR_INVALID_ARGUMENT = INVALID
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_SUCCESS = pynvml.NVML_SUCCESS

    def __init__(self, gpus, **kw):
        super().__init__(gpus, **kw)
        self.link_calls = 0

    def nvmlDeviceGetNvLinkState(self, h, link):
        self.link_calls += 1
        links = self.gpus[h.index].get("nvlink", "pcie")
        if links == "pcie":
            assert INVENTORY["nvlink"][str(link)]["state"].startswith("ERR:NVMLError_NotSupported")
            raise pynvml.NVMLError(NS)
        if link >= len(links):
            raise pynvml.NVMLError(INVALID)
        return links[link]

    def nvmlDeviceGetGpuFabricInfo(self, h):
        fabric = self.gpus[h.index].get("fabric", (0, 0))
        if isinstance(fabric, int):
            raise pynvml.NVMLError(fabric)
        return SimpleNamespace(state=fabric[0], status=fabric[1], clusterUuid=b"\0" * 16, cliqueId=0)


def sample(fake, now=1.0):
    with NvmlCollector(node="n1", nvml=fake, events=False) as c:
        return c.collect(now)["gpu_samples"]


# -- NVML --------------------------------------------------------------------------------------------


def test_pcie_gpu_has_no_nvlink_and_no_fabric():
    """The real H200's answers: NotSupported for every link and for the fabric info."""
    fake = FabricNvml([h200("GPU-a", fabric=NS)])
    row = sample(fake).row(0, named=True)
    assert (row["nvlink_links_total"], row["nvlink_links_up"], row["fabric_manager_status"]) == (0, 0, 0)


def test_links_are_found_once_then_read_each_sample():
    fake = FabricNvml([h200("GPU-a", nvlink=[1] * 18, fabric=(3, 0)), h200("GPU-b", nvlink=[1] * 17 + [0], fabric=(3, pynvml.NVML_ERROR_TIMEOUT))])
    with NvmlCollector(node="n1", nvml=fake, events=False) as c:
        first = c.collect(1.0)["gpu_samples"]
        discovery = fake.link_calls
        fake.gpus[0]["nvlink"] = [1] * 16 + [0, 0]
        second = c.collect(2.0)["gpu_samples"]
    assert discovery == 2 * 18 + 2 * 18  # each of NVML's 18 link indexes probed once, then the links read
    assert fake.link_calls - discovery == 2 * 18  # later samples read only the known links
    assert first.select("nvlink_links_total", "nvlink_links_up", "fabric_manager_status").rows() == [(18, 18, 3), (18, 17, 4)]
    assert second["nvlink_links_up"].to_list() == [16, 17]


@pytest.mark.parametrize(("fabric", "want"), [((0, 0), 0), ((1, 0), 1), ((2, 0), 2), ((3, 0), 3), ((3, pynvml.NVML_ERROR_UNKNOWN), 4), ((27, 0), 5),
                                              (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, 6), (pynvml.NVML_ERROR_UNKNOWN, None)])
def test_fabric_info_maps_onto_dcgm_status(fabric, want):
    assert sample(FabricNvml([h200("GPU-a", nvlink=[1] * 18, fabric=fabric)]))["fabric_manager_status"].to_list() == [want]


def test_remap_pending_from_remapped_rows():
    row = sample(FabricNvml([h200("GPU-a", remapped=(2, 1, 1, 0))])).row(0, named=True)
    assert (row["retired_pages_total"], row["row_remap_pending"], row["remap_failure"]) == (3, True, False)


# -- dcgm-exporter -----------------------------------------------------------------------------------

LABELS = 'gpu="{g}",UUID="GPU-{g}",pci_bus_id="00000000:0{g}:00.0",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="node07"'


def exposition(fm=(3, 3), pending=(0, 0), retired=(0, 0)) -> str:
    out = []
    for name, values, help in (
        ("DCGM_FI_DEV_FABRIC_MANAGER_STATUS", fm, "The status of the fabric manager"),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", pending, "Whether remapping of rows is pending"),
        ("DCGM_FI_DEV_RETIRED_PENDING", retired, "Number of pages pending retirement"),
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", (0, 0), "Number of remapped rows for uncorrectable errors"),
    ):
        out += [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
        out += [f"{name}{{{LABELS.format(g=g)}}} {v}" for g, v in enumerate(values)]
    return "\n".join(out) + "\n"


def test_dcgm_fields_fill_the_columns():
    samples, _, _ = dcgm.parse_text(exposition(fm=(3, 4), pending=(0, 1), retired=(2, 0)), ts=5.0)
    got = samples.select("gpu", "fabric_manager_status", "row_remap_pending", "retired_pages_pending", "nvlink_links_total").rows()
    assert got == [(0, 3, False, True, None), (1, 4, True, False, None)]  # DCGM has no per-link state field


# -- detectors ----------------------------------------------------------------------------------------

ALLOC = schemas.frame([{"job": "pretrain", "rank": 5, "node": "n1", "gpu": 1}], schemas.ALLOCATIONS)


def run(det, frames):
    w = Window(1e9)
    w.add("allocations", ALLOC)
    out = []
    for t, df in frames:
        w.add("gpu_samples", df)
        w.seal(float(t))
        out.append(det.detect(w))
    return out


def rows(t, *gpus):
    return schemas.frame([{"ts": float(t), "node": "n1", "gpu": i, **g} for i, g in enumerate(gpus)], schemas.GPU_SAMPLES)


def links(up, total=18, fm=3):
    return {"nvlink_links_total": total, "nvlink_links_up": up, "fabric_manager_status": fm}


def test_a_link_going_down_pages_on_that_gpu():
    det = NvlinkFabricDetector()
    out = run(det, [(0, rows(0, links(18), links(18))), (1, rows(1, links(18), links(17)))])
    assert out[0] == []
    [f] = out[1]
    assert (f.kind.value, f.severity.value, f.node, f.gpu, f.job, f.ranks) == ("nvlink_down", "page", "n1", 1, "pretrain", [5])
    assert f.evidence == {"nvlink_links_up": 17, "nvlink_links_total": 18, "expected_up": 18, "expected_from": "itself"}


def test_down_from_the_start_is_seen_against_peers():
    det = NvlinkFabricDetector()
    [out] = run(det, [(0, rows(0, links(18), links(18), links(12)))])
    [f] = out
    assert (f.gpu, f.evidence["expected_up"], f.evidence["expected_from"]) == (2, 18, "peers")


def test_pcie_gpus_and_unfitted_bridges_are_never_down():
    """The known false positives: a PCIe GPU (0 links: NVML NotSupported everywhere) and GPUs
    whose links are all down alike (an NVLink bridge that is not fitted)."""
    det = NvlinkFabricDetector()
    assert run(det, [(0, rows(0, links(0, 0, 0), links(0, 0, 0))), (1, rows(1, links(0, 0, 0), links(0, 0, 0)))]) == [[], []]
    det = NvlinkFabricDetector()
    assert run(det, [(0, rows(0, links(0, 12, 0), links(0, 12, 0)))]) == [[]]


def test_fabric_failure_pages_at_once_in_progress_only_after_settling():
    det = NvlinkFabricDetector()
    out = run(det, [(t, rows(t, links(18, fm=4), links(18, fm=2))) for t in (0, 100, 299, 301)])
    assert [sorted((f.gpu, f.evidence["status"]) for f in o) for o in out] == [[(0, "failure")], [(0, "failure")], [(0, "failure")], [(0, "failure"), (1, "in progress")]]
    assert all(f.kind.value == "fabric_manager" and f.severity.value == "page" for f in out[-1])


def test_fabric_not_started_is_single_node_normal_unless_required():
    """IMEX never starts on a single-node system: not a finding by default."""
    frames = [(t, rows(t, links(18, fm=1))) for t in (0, 400)]
    assert run(NvlinkFabricDetector(), frames) == [[], []]
    det = NvlinkFabricDetector(config.load(overrides={"detectors": {"nvlink_fabric": {"require_fabric": True}}}))
    out = run(det, frames)
    assert out[0] == [] and out[1][0].evidence["status"] == "not started"


def test_fabric_from_dcgm_alone_without_link_counts():
    samples, _, _ = dcgm.parse_text(exposition(fm=(3, 4)), ts=5.0)
    [[f]] = run(NvlinkFabricDetector(), [(5, samples)])
    assert (f.node, f.gpu, f.evidence["status"]) == ("node07", 1, "failure")


def test_remap_pending_and_retired_pages():
    det = MemoryRepairDetector()
    df = rows(0, {"row_remap_pending": True, "retired_pages_total": 3}, {"retired_pages_pending": True, "retired_pages_total": 5},
              {"retired_pages_total": 60}, {"retired_pages_total": 59, "row_remap_pending": False})
    [out] = run(det, [(0, df)])
    got = sorted((f.kind.value, f.gpu, f.severity.value) for f in out)
    assert got == [("retired_pages", 1, "ticket"), ("retired_pages", 2, "ticket"), ("row_remap_pending", 0, "ticket")]
    by = {(f.kind.value, f.gpu): f for f in out}
    assert by[("retired_pages", 1)].job == "pretrain" and "reboot" in by[("retired_pages", 1)].summary
    assert by[("retired_pages", 2)].evidence == {"retired_pages_pending": False, "retired_pages_total": 60, "limit": 60}
    assert "GPU reset" in by[("row_remap_pending", 0)].summary


def test_memory_repair_from_dcgm_and_quiet_when_healthy():
    assert run(MemoryRepairDetector(), [(5, dcgm.parse_text(exposition(), ts=5.0)[0])]) == [[]]
    [out] = run(MemoryRepairDetector(), [(5, dcgm.parse_text(exposition(pending=(1, 0), retired=(0, 4)), ts=5.0)[0])])
    assert sorted((f.kind.value, f.node, f.gpu) for f in out) == [("retired_pages", "node07", 1), ("row_remap_pending", "node07", 0)]
