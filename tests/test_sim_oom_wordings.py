"""The simulator's CUDA OOM messages, in every wording and wrapped over lines as loggers do, read
back with the figures they carry: a wrapped message keeps its cause, and exactly the wordings the
simulator marks as carrying no figures are the ones no cause can be read from."""

from __future__ import annotations

import numpy as np
import pytest

from gpuvigil.model import FindingKind
from gpuvigil.parsers.oom import load_oom_config, parse_oom
from gpuvigil.sim import faults

GIB = 1 << 30
CAP = 139.8 * GIB
CTX = 0.6 * GIB
# (request, process_in_use, allocated, unallocated, foreign) as the simulator's OOM paths build them.
CAUSES = {
    FindingKind.OOM_CAPACITY: dict(request=3.25 * GIB, process_in_use=137 * GIB + CTX, allocated=133.75 * GIB, unallocated=0.0, foreign=0.0),
    FindingKind.OOM_FRAGMENTATION: dict(request=4.97 * GIB, process_in_use=138 * GIB + CTX, allocated=64 * GIB, unallocated=73.8 * GIB, foreign=0.0),
    FindingKind.OOM_FOREIGN_PROCESS: dict(request=5.15 * GIB, process_in_use=66 * GIB + CTX, allocated=66 * GIB, unallocated=0.0, foreign=71.6 * GIB),
}
WORDINGS = [w for w, _ in faults.OOM_WORDINGS]


@pytest.mark.parametrize("wording", WORDINGS)
@pytest.mark.parametrize("kind", list(CAUSES))
def test_a_wrapped_message_reads_like_the_unwrapped_one(kind, wording):
    rng = np.random.default_rng(0)
    reads = []
    for split in (False, True):
        _, msg = faults.oom_message(rng, capacity=CAP, rank=3, wording=wording, split=split, **CAUSES[kind])
        assert ("\n" in msg) == (split or wording in ("cublas", "nccl"))
        rep = parse_oom(msg, rank=3)
        reads.append(None if rep is None else (rep.requested_bytes, rep.free_bytes, rep.reserved_unallocated_bytes, rep.foreign_bytes(), rep.classify(load_oom_config())))
    assert reads[0] == reads[1], (kind, wording)
    if wording in faults.OOM_WORDINGS_WITHOUT_FIGURES:
        assert reads[0] is None
    else:
        assert reads[0] is not None
        # torch 1.x lists no other process: its foreign OOM reads as capacity (parsers/oom.py
        # counts other processes only where the message shows them).
        want = FindingKind.OOM_CAPACITY if (wording == "torch_1x" and kind == FindingKind.OOM_FOREIGN_PROCESS) else kind
        assert reads[0][-1] == want, (kind, wording)
