"""NVML through batched field values (`nvmlDeviceGetFieldValues`), with a status per field.

No GPU or driver here, so NVML is `FakeNvml` (tests/test_nvml.py: an in-memory pynvml with the
same names and pynvml's own NVMLError classes) extended with `nvmlDeviceGetFieldValues`, which
returns real `pynvml.c_nvmlFieldValue_t` structures. The value types per field (ECC totals as
unsigned long long, the PCIe replay counter as unsigned int, NotSupported for retired pages on
an H200) are those a real H200 returned (tests/data/h200/nvml_inventory.json, `field_values`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pynvml
import pytest

from gpuvigil import schemas
from gpuvigil.gpu import throttle
from gpuvigil.collectors.nvml import FIELD_IDS, NvmlCollector
from test_nvml import FakeNvml, h200

INVENTORY = json.loads((Path(__file__).parent / "data" / "h200" / "nvml_inventory.json").read_text())
FV = INVENTORY["field_values"]


class BatchingNvml(FakeNvml):
    """FakeNvml plus the batch API; counts every NVML call per function."""

    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_FI_DEV_ECC_DBE_VOL_TOTAL = pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL

    def __init__(self, gpus, *, fields: dict[int, dict[int, tuple[int, int, float]]], batch_error: int | None = None, **kw):
        super().__init__(gpus, **kw)
        self.fields = fields  # gpu → field id → (nvmlReturn, valueType, value)
        self.batch_error = batch_error
        self.calls: Counter[str] = Counter()
        self.batches: list[list[int]] = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name.startswith("nvmlDevice") and callable(attr):
            calls = super().__getattribute__("calls")

            def counted(*args, **kwargs):
                calls[name] += 1
                return attr(*args, **kwargs)

            return counted
        return attr

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        if self.batch_error is not None:
            raise pynvml.NVMLError(self.batch_error)
        self.batches.append(list(field_ids))
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
        for k, fid in enumerate(field_ids):
            ret, vtype, val = self.fields[h.index].get(fid, (pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0))
            values[k].fieldId = fid
            values[k].nvmlReturn = ret
            values[k].valueType = vtype
            setattr(values[k].value, member[vtype], type(getattr(values[k].value, member[vtype]))(val))
        return values


def real_h200_fields(over: dict | None = None) -> dict[int, tuple[int, int, float]]:
    ull, ui = 3, 1
    f = {
        pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (0, ull, 3),
        pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (FV["4"]["ret"], FV["4"]["type"], int(FV["4"]["val"])),
        pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (0, ull, 12),
        pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (0, ull, 1),
        pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (FV["94"]["ret"], FV["94"]["type"], 5),
        pynvml.NVML_FI_DEV_REMAPPED_COR: (0, ui, 2),
        pynvml.NVML_FI_DEV_REMAPPED_UNC: (0, ui, 1),
        pynvml.NVML_FI_DEV_REMAPPED_FAILURE: (0, ui, 0),
        144: (0, ui, 0),  # NVML_FI_DEV_REMAPPED_PENDING, of the same group as 142/143/145 (not in the capture)
        pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: (0, ull, 10_000_000),
        pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: (0, ull, 50_000_000),
        # RETIRED_SBE/DBE: NotSupported on Hopper (rows are remapped instead)
    }
    f.update(over or {})
    return f


def test_one_batch_per_gpu_gives_the_same_row_in_fewer_calls():
    batched = BatchingNvml([h200("GPU-a"), h200("GPU-b")], fields={0: real_h200_fields(), 1: real_h200_fields()})
    legacy = BatchingNvml([h200("GPU-a"), h200("GPU-b")], fields={})
    legacy.nvmlDeviceGetFieldValues = None  # a driver without the batch API
    with NvmlCollector(node="n1", nvml=batched, events=False) as a, NvmlCollector(node="n1", nvml=legacy, events=False) as b:
        assert a.field_values and not b.field_values
        batched.calls.clear(), legacy.calls.clear()
        ra = a.collect(10.0)["gpu_samples"]
        rb = b.collect(10.0)["gpu_samples"]
        assert a.errors == 0 and b.errors == 0
    same = [c for c in schemas.GPU_SAMPLES if not c.startswith("pcie_tx") and not c.startswith("pcie_rx")]
    assert ra.select(same).rows() == rb.select(same).rows()
    row = ra.row(0, named=True)
    assert (row["ecc_sbe_volatile_total"], row["ecc_dbe_volatile_total"], row["ecc_dbe_aggregate_total"]) == (3, 0, 1)
    assert (row["retired_pages_total"], row["remap_failure"], row["pcie_replay_total"]) == (3, False, 5)
    assert row["memory_reserved_bytes"] == 644939776
    per_gpu_batched = sum(batched.calls.values()) / 2
    per_gpu_legacy = sum(legacy.calls.values()) / 2
    assert batched.calls["nvmlDeviceGetFieldValues"] == 2
    assert per_gpu_batched <= 10 < 14 <= per_gpu_legacy, (batched.calls, legacy.calls)
    assert not batched.calls["nvmlDeviceGetTotalEccErrors"] and not batched.calls["nvmlDeviceGetRemappedRows"]


def test_not_supported_fields_fall_back_one_by_one_and_leave_the_batch():
    ns = pynvml.NVML_ERROR_NOT_SUPPORTED
    fields = real_h200_fields()
    for fid in (pynvml.NVML_FI_DEV_REMAPPED_COR, pynvml.NVML_FI_DEV_REMAPPED_UNC, pynvml.NVML_FI_DEV_REMAPPED_FAILURE, pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL):
        del fields[fid]  # pre-Ampere: no remapped rows; and this driver has no aggregate SBE field
    fields[pynvml.NVML_FI_DEV_RETIRED_SBE] = (0, 3, 1)
    fields[pynvml.NVML_FI_DEV_RETIRED_DBE] = (0, 3, 2)
    fake = BatchingNvml([h200("GPU-v100", remapped=None)], fields={0: fields}, errors={(0, "remapped"): ns})
    with NvmlCollector(node="n", nvml=fake, events=False) as c:
        row = c.collect(1.0)["gpu_samples"].row(0, named=True)
        assert row["retired_pages_total"] == 3 and row["remap_failure"] is None  # retired pages from the batch
        assert row["ecc_sbe_aggregate_total"] == 12  # read through its own call instead
        assert fake.calls["nvmlDeviceGetTotalEccErrors"] == 1
        assert {"remapped_cor", "remapped_unc", "remapped_failure", "ecc_sbe_aggregate_total"} <= set(c.not_supported)
        c.collect(2.0)
        second = fake.batches[-1]
    assert pynvml.NVML_FI_DEV_REMAPPED_COR not in second and pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL not in second
    assert pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL in second and c.errors == 0


def test_a_failing_field_is_null_and_counted_not_the_whole_sample():
    lost = pynvml.NVML_ERROR_GPU_IS_LOST
    fake = BatchingNvml([h200("GPU-a")], fields={0: real_h200_fields({pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (lost, 3, 0)})})
    with NvmlCollector(node="n", nvml=fake, events=False) as c:
        row = c.collect(1.0)["gpu_samples"].row(0, named=True)
        assert row["ecc_dbe_volatile_total"] is None and row["ecc_sbe_volatile_total"] == 3 and c.errors == 1


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED])
def test_a_driver_without_the_batch_api_falls_back_to_single_calls(code):
    fake = BatchingNvml([h200("GPU-a")], fields={0: real_h200_fields()}, batch_error=code)
    with NvmlCollector(node="n", nvml=fake, events=False) as c:
        row = c.collect(1.0)["gpu_samples"].row(0, named=True)
        assert not c.field_values and c.errors == 0
        assert (row["ecc_sbe_volatile_total"], row["retired_pages_total"], row["pcie_replay_total"]) == (3, 3, 5)
        c.collect(2.0)
    assert fake.calls["nvmlDeviceGetFieldValues"] == 1  # not asked again


def test_pcie_byte_counters_become_rates():
    fields = real_h200_fields()
    fake = BatchingNvml([h200("GPU-a")], fields={0: fields})
    with NvmlCollector(node="n", nvml=fake, events=False) as c:
        first = c.collect(10.0)["gpu_samples"].row(0, named=True)
        assert first["pcie_tx_bytes_per_second"] is None  # a rate needs two samples
        fields[pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES] = (0, 3, 30_000_000)
        fields[pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES] = (0, 3, 40_000_000)  # went backwards: a reset
        second = c.collect(12.0)["gpu_samples"].row(0, named=True)
    assert second["pcie_tx_bytes_per_second"] == pytest.approx(10_000_000) and second["pcie_rx_bytes_per_second"] is None


def test_field_ids_match_nvml_h_and_the_throttle_table_matches_pynvml():
    for name, (const, value) in FIELD_IDS.items():
        assert getattr(pynvml, const) == value, name
    for r in throttle.REASONS:
        assert getattr(pynvml, f"nvmlClocksEventReason{r.nvml}") == r.bit, r.name
    assert throttle.THERMAL_MASK == 0x68 and throttle.active(0x24, short=True) == ["power_cap", "sw_thermal"]
    assert sum(r.bit for r in throttle.REASONS) == pynvml.nvmlClocksEventReasonAll


def test_pci_and_uuid_maps_for_the_kernel_log_and_the_job_map():
    from types import SimpleNamespace

    from gpuvigil.collectors import kernel_log

    class WithPci(BatchingNvml):
        def nvmlDeviceGetPciInfo(self, h):
            # the real H200's busId (as pynvml returns it: bytes), one device further for GPU 1
            bus = INVENTORY["pci"]["busId"] if h.index == 0 else "00000000:00:07.0"
            return SimpleNamespace(busId=bus.encode())

    fake = WithPci([h200("GPU-a"), h200("GPU-b")], fields={0: real_h200_fields(), 1: real_h200_fields()})
    with NvmlCollector(node="n", nvml=fake, events=False) as c:
        assert c.pci_to_gpu() == {"00000000:00:06.0": 0, "00000000:00:07.0": 1}
        assert c.uuid_to_gpu() == {"GPU-a": 0, "GPU-b": 1}
        df = kernel_log.parse_lines(["[5.0] NVRM: Xid (PCI:0000:00:07): 79, pid=1, name=python, GPU has fallen off the bus."], pci_to_gpu=c.pci_to_gpu())
    assert df["gpu"].to_list() == [1]
