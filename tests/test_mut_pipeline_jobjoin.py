"""dcgm-exporter's attribution labels become the node's GPU → job map (gpuvigil/pipeline/jobjoin.py:
from_dcgm), on what the fast tests did not check (mutation testing, docs/testing.md): an
`hpc_job` label names the job (source `dcgm_hpc_job`), a pod label names `namespace/pod`
(source `dcgm_pod`), and a GPU with neither is not mapped.

Data: tests/data/dcgm/node07_constructed.prom (dcgm-exporter's field list and labels with the real
H200's values; GPU 1 runs pod llm/llama-pretrain-worker-3, GPU 0 nothing), parsed by the real
`dcgm.parse_text`, plus one constructed scrape line with an `hpc_job` label (the label form of
tests/test_dcgm.py::test_label_variants).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from gpuvigil.collectors import dcgm
from gpuvigil.pipeline.jobjoin import JobJoin, from_dcgm

SCRAPE = Path(__file__).parent / "data" / "dcgm" / "node07_constructed.prom"
TS = 1_700_000_000.0


def test_dcgm_labels_name_the_job_and_their_source():
    _, pods, _ = dcgm.parse_text(SCRAPE.read_text(), ts=TS)
    text = '# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{gpu="3",UUID="GPU-a",Hostname="gpu-node-07",hpc_job="slurm-991"} 10\n'
    _, slurm, _ = dcgm.parse_text(text, ts=TS)
    got = from_dcgm(pl.concat([pods, slurm], how="vertical_relaxed"))
    assert got.select("node", "gpu", "job", "source").sort("gpu").rows() == [
        ("gpu-node-07", 1, "llm/llama-pretrain-worker-3", "dcgm_pod"),
        ("gpu-node-07", 3, "slurm-991", "dcgm_hpc_job"),
    ]


def test_a_dcgm_only_node_gets_the_job_map_in_allocations():
    """Through JobJoin: the workloads alone (no scheduler, no gpu_jobs) fill allocations with the
    GPU's job."""
    text = '# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{gpu="3",UUID="GPU-a",Hostname="gpu-node-07",hpc_job="slurm-991"} 10\n'
    _, workloads, _ = dcgm.parse_text(text, ts=TS)
    out = dict(JobJoin().apply([("gpu_workloads", workloads)]))
    assert out["allocations"].select("node", "gpu", "job").rows() == [("gpu-node-07", 3, "slurm-991")]
