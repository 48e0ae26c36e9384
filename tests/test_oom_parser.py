"""`gpuvigil.parsers.oom` on the real OOM messages of every PyTorch generation (tests/data/public/,
labelled in labels.yaml by the written rule of LABELS.md; tests/data/h200/ captures), and on garbage:
the parser reads untrusted logs, so whatever a message is cut, mangled or padded into, it returns
None or a report whose figures are sizes, and classifying and explaining it never fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuvigil.model import FindingKind
from gpuvigil.parsers.oom import load_oom_config, parse_oom

DATA = Path(__file__).parent / "data"
PUBLIC = DATA / "public"
LABELS = [r for r in yaml.safe_load((PUBLIC / "labels.yaml").read_text())["examples"] if r["category"] == "oom"]
MESSAGES = [" ".join((PUBLIC / r["file"]).read_text().split()) for r in LABELS]
GIB = 1 << 30
MIB = 1 << 20
CFG = load_oom_config()


@pytest.mark.parametrize("row", LABELS, ids=lambda r: Path(r["file"]).stem)
def test_every_figure_the_label_was_computed_from_is_read(row):
    """The parser reads the same figures the label was transcribed from (0.01 GiB as printed),
    whatever the wording: no message that carries its figures is left without them."""
    rep = parse_oom(" ".join((PUBLIC / row["file"]).read_text().split()))
    fig = row["figures_gib"]
    assert rep is not None and rep.free_bytes is not None, row["file"]
    for key, got in (("request", rep.requested_bytes), ("free", rep.free_bytes), ("total", rep.total_bytes),
                     ("allocated", rep.allocated_bytes), ("unalloc", rep.reserved_unallocated_bytes)):
        if key in fig:
            assert got is not None and got / GIB == pytest.approx(fig[key], abs=0.006), (row["file"], key)
    if "process_lines" in fig:
        shown = sorted(round(p["bytes"] / GIB, 2) for p in rep.other_processes)
        assert len(shown) <= len(fig["process_lines"])
    assert rep.classify(CFG) == FindingKind(row["expect"][0])


@pytest.mark.parametrize(
    "name, wording, kind",
    [
        ("oom_wordings_l1.log", "old", FindingKind.OOM_UNEXPLAINED),      # torch ≤1.3 "cached"
        ("oom_opixray_5.log", "old", FindingKind.OOM_CAPACITY),           # "reserved in total by PyTorch"
        ("oom_wordings_l3.log", "capacty", FindingKind.OOM_CAPACITY),     # torch 2.1's typo
        ("oom_fooocus_1902.log", "capacty", FindingKind.OOM_FRAGMENTATION),
        ("oom_cads_4.log", "new", FindingKind.OOM_CAPACITY),              # 2.2+ "this process has"
        ("oom_keysvalues_92.log", "new", FindingKind.OOM_FOREIGN_PROCESS),
        ("oom_comfyui_9529_hip.log", "new", FindingKind.OOM_UNEXPLAINED),  # ROCm
        ("oom_zimage_103_hip.log", "new", FindingKind.OOM_CAPACITY),
    ],
)
def test_each_generation_s_wording(name, wording, kind):
    path = PUBLIC / "corpus" / name if (PUBLIC / "corpus" / name).exists() else PUBLIC / name
    rep = parse_oom(path.read_text())
    assert rep is not None and (rep.wording, rep.classify(CFG)) == (wording, kind)


def test_cache_smaller_than_the_request_is_not_fragmentation_whatever_free_adds():
    """OPIXray#5: 264 MiB asked; 145.93 MiB free and 255.97 MiB cached (1.02 GiB reserved - 788.51
    MiB allocated) add up to more, but the cache is only free pieces of segments in use (the
    allocator handed wholly free ones back before raising): neither could hold the request."""
    rep = parse_oom((PUBLIC / "corpus" / "oom_opixray_5.log").read_text())
    assert rep is not None
    assert rep.reserved_unallocated_bytes < rep.requested_bytes <= rep.free_bytes + rep.reserved_unallocated_bytes  # type: ignore[operator]
    assert rep.classify(CFG) == FindingKind.OOM_CAPACITY
    assert "PyTorch's cache holds only 0.25 GiB" in rep.reason(FindingKind.OOM_CAPACITY)


@pytest.mark.parametrize(
    "name, margin_mib",
    [("oom_wordings_l3.log", 9.56), ("oom_vllm_12529.log", 10.24), ("oom_structureflow_35.log", 71.68)],
)
def test_free_memory_within_the_driver_s_headroom_is_a_full_device(name, margin_mib):
    """The message carries every figure and free memory exceeds the request by only a little:
    the driver cannot hand out all of it (pages, its own bookkeeping): capacity, not unexplained."""
    rep = parse_oom((PUBLIC / "corpus" / name).read_text())
    assert rep is not None and rep.free_bytes is not None
    assert (rep.free_bytes - rep.requested_bytes) / MIB == pytest.approx(margin_mib, abs=6)
    assert rep.free_bytes >= rep.requested_bytes and rep.classify(CFG) == FindingKind.OOM_CAPACITY


def test_headroom_and_its_configuration():
    """The same 2.2+ message with free memory just under and just over the headroom (crafted from
    the H200 s2 wording), and with the headroom configured away."""
    from gpuvigil.parsers.oom import OomClassifyConfig

    def msg(free_mib: float) -> str:
        return (f"CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which {free_mib:.2f} MiB is free. "
                "Including non-PyTorch memory, this process has 135.00 GiB memory in use. Of the allocated memory 134.00 GiB is allocated by PyTorch, "
                "and 0 bytes is reserved by PyTorch but unallocated.")

    headroom = max(64, 0.01 * 4096)  # MiB: the larger of the floor and 1% of the request
    assert parse_oom(msg(4096 + headroom - 1)).classify(CFG) == FindingKind.OOM_CAPACITY  # type: ignore[union-attr]
    assert parse_oom(msg(4096 + headroom + 1)).classify(CFG) == FindingKind.OOM_UNEXPLAINED  # type: ignore[union-attr]
    none = OomClassifyConfig(driver_headroom_bytes=0, driver_headroom_fraction=0.0)
    assert parse_oom(msg(4096)).classify(none) == FindingKind.OOM_UNEXPLAINED  # type: ignore[union-attr]


def test_a_memory_fraction_caps_the_free_memory():
    """Crafted in the torch 1.x wording with `set_per_process_memory_fraction`'s "X allowed;" clause
    (as c10's allocator prints it): 5.50 GiB free, but 1.25 GiB allowed with 1.24 GiB reserved leaves
    this process 10 MiB: a capacity OOM of the allowance, not an unexplained one."""
    rep = parse_oom("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; 1.23 GiB already allocated; "
                    "5.50 GiB free; 1.25 GiB allowed; 1.24 GiB reserved in total by PyTorch)")
    assert rep is not None and rep.allowed_bytes == round(1.25 * GIB) and rep.free_bytes == round(5.50 * GIB)
    assert rep.usable_free_bytes() == pytest.approx(0.01 * GIB, abs=MIB)
    assert rep.classify(CFG) == FindingKind.OOM_CAPACITY
    assert "the memory fraction leaves 0.01 GiB" in rep.reason(FindingKind.OOM_CAPACITY)


# --- garbage -------------------------------------------------------------------------------

_JUNK = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
_NUMBER = st.one_of(st.just("0"), st.just("-1"), st.just("1e308"), st.just("9" * 40), st.just("9" * 400), st.just("1." + "9" * 400), st.just("0.0000001"), st.just("."),
                    st.integers(0, 10**30).map(str), st.floats(0, 1e30, allow_nan=False).map(lambda f: f"{f:.2f}"))


@st.composite
def mangled(draw) -> str:
    """A real OOM message with figures replaced, spans cut, junk spliced in, clauses repeated."""
    text = draw(st.sampled_from(MESSAGES))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["number", "cut", "splice", "repeat", "unit"]))
        if op == "number":
            import re

            spots = [m.span() for m in re.finditer(r"\d+(?:\.\d+)?", text)]
            if spots:
                a, b = draw(st.sampled_from(spots))
                text = text[:a] + draw(_NUMBER) + text[b:]
        elif op == "cut":
            a = draw(st.integers(0, len(text)))
            text = text[:a] + text[draw(st.integers(a, len(text))):]
        elif op == "splice":
            a = draw(st.integers(0, len(text)))
            text = text[:a] + draw(_JUNK) + text[a:]
        elif op == "repeat":
            a = draw(st.integers(0, len(text)))
            b = draw(st.integers(a, min(len(text), a + 200)))
            text = text[:b] + text[a:b] * draw(st.integers(1, 50)) + text[b:]
        else:
            text = text.replace(draw(st.sampled_from(["GiB", "MiB", "bytes", "KiB"])), draw(st.sampled_from(["TiB", "B", "GB", "", "iB"])))
    return text


def _survives(text: str) -> None:
    rep = parse_oom(text, line=7, ts=1.0, rank=3)
    if rep is None:
        return
    for v in (rep.requested_bytes, rep.total_bytes, rep.free_bytes, rep.allocated_bytes, rep.reserved_unallocated_bytes,
              rep.process_used_bytes, rep.allowed_bytes, rep.foreign_bytes(), rep.non_pytorch_bytes(), rep.usable_free_bytes()):
        assert v is None or (isinstance(v, int) and v >= 0), v
    kind = rep.classify(CFG)
    assert kind in {FindingKind.OOM_CAPACITY, FindingKind.OOM_FRAGMENTATION, FindingKind.OOM_FOREIGN_PROCESS, FindingKind.OOM_UNEXPLAINED}
    reason = rep.reason(kind)
    assert isinstance(reason, str) and reason and "None" not in reason
    hash(rep.key())
    assert len(rep.text) <= 800


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mangled())
def test_mangled_real_messages_never_break_the_parser(text):
    _survives(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000))
@example("9" * 400 + " GiB. GPU 0 has a total capacity of 1.00 GiB of which 0 bytes is free.")  # once overflowed to infinity
def test_any_text_never_breaks_the_parser(text):
    _survives(text)
    _survives("CUDA out of memory. Tried to allocate " + text)
    _survives("HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of " + text)
