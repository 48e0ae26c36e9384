"""The restricted unpickler: real torch dumps load; crafted malicious pickles are refused, and
nothing they name is ever called."""

from __future__ import annotations

import os
import pickle
import pickletools
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil.collectors.safe_pickle import PickleReadError, UnsafePickleError, safe_load
from gpuvigil.errors import UserError

DATA = Path(__file__).parent / "data" / "h200"


@pytest.mark.parametrize("name", ["s3_snapshot.pickle", "s4_snapshot.pickle", "s5_fr_dump.pickle", "s6_fr_rank_0"])
def test_real_torch_dumps_load_and_reference_no_global(name):
    raw = (DATA / name).read_bytes()
    opcodes = {op.name for op, _arg, _pos in pickletools.genops(raw)}
    assert not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4"}
    assert safe_load(DATA / name) == safe_load(raw)
    assert isinstance(safe_load(raw), dict)


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_plain_data_round_trips_in_every_protocol(protocol):
    value = {
        "a": [1, 2.5, None, True, "x", b"\x00\xff", (1, (2,)), {3, 4}, frozenset({5})],
        "b": bytearray(b"abc"),
        "big": 2**100,
    }
    assert safe_load(pickle.dumps(value, protocol=protocol)) == value


class _Evil:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def _evil_cases(tmp_path: Path):
    marker = str(_marker(tmp_path))
    touch = f"touch {marker}"
    return {
        "os.system": (pickle.dumps(_Evil(os.system, touch)), "system"),
        "builtins.eval": (pickle.dumps(_Evil(eval, f"open({marker!r}, 'w')")), "builtins.eval"),
        "builtins.exec": (pickle.dumps(_Evil(exec, f"open({marker!r}, 'w')"), protocol=0), "exec"),
        "subprocess.Popen": (pickle.dumps(_Evil(subprocess.Popen, ["touch", marker])), "subprocess.Popen"),
        "nested in plain data": (pickle.dumps({"entries": [{"ok": 1}, [_Evil(os.system, touch)]]}), "system"),
        "builtins.open via protocol 2": (pickle.dumps(_Evil(open, marker, "w"), protocol=2), "io.open"),
        "getattr chain": (pickle.dumps(_Evil(getattr, Path, "home")), "builtins.getattr"),
        # Hand-written protocol-0 GLOBAL + REDUCE, as an attacker would write it.
        "hand-written GLOBAL": (b"cos\nsystem\n(S'" + touch.encode() + b"'\ntR.", "os.system"),
        "hand-written INST": (b"(S'" + touch.encode() + b"'\nios\nsystem\n.", "os.system"),
        "class instance": (pickle.dumps(Path("/etc/passwd")), "pathlib"),
        "zlib codec bomb": (b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x0a\x00\x00\x00zlib_codec\x86R.", "zlib_codec"),
        "bytearray size bomb": (b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x7f\x85R.", "bytearray"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "os.system",
        "builtins.eval",
        "builtins.exec",
        "subprocess.Popen",
        "nested in plain data",
        "builtins.open via protocol 2",
        "getattr chain",
        "hand-written GLOBAL",
        "hand-written INST",
        "class instance",
        "zlib codec bomb",
        "bytearray size bomb",
    ],
)
def test_malicious_pickles_are_refused_and_not_executed(tmp_path, case):
    payload, refused_name = _evil_cases(tmp_path)[case]
    evil_file = tmp_path / "rank_0.pickle"
    evil_file.write_bytes(payload)
    for source in (payload, evil_file):
        with pytest.raises(UnsafePickleError, match=refused_name.replace(".", r"\.")) as info:
            safe_load(source)
        assert isinstance(info.value, UserError)
    assert not _marker(tmp_path).exists()
    assert str(evil_file) in _message_for(evil_file)


def _message_for(path: Path) -> str:
    try:
        safe_load(path)
    except UserError as exc:
        return str(exc)
    raise AssertionError("expected a UserError")


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "empty"),
        (b"\x80\x04\x95", "not a valid pickle"),
        (b"not a pickle at all", "not a valid pickle"),
        (b"\x80\x05\x97.", "not a valid pickle"),  # protocol 5 out-of-band buffer
        (b"\x80\x02P0\n.", "persistent id"),
    ],
)
def test_garbage_is_a_user_error(payload, reason):
    with pytest.raises(UserError, match=reason):
        safe_load(payload)


def test_size_limit_is_enforced_before_reading(tmp_path):
    big = tmp_path / "big.pickle"
    big.write_bytes(pickle.dumps(list(range(1000))))
    with pytest.raises(PickleReadError, match="larger than the 100-byte limit"):
        safe_load(big, max_bytes=100)
    with pytest.raises(PickleReadError, match="larger than"):
        safe_load(big.read_bytes(), max_bytes=100)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(PickleReadError, match="nope.pickle: cannot read"):
        safe_load(tmp_path / "nope.pickle")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_user_error(data):
    try:
        safe_load(data)
    except UserError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["s3_snapshot.pickle", "s5_fr_dump.pickle", "s6_fr_rank_0"]), st.data())
def test_truncated_and_corrupted_real_dumps_only_raise_user_error(name, data):
    raw = (DATA / name).read_bytes()
    cut = data.draw(st.integers(0, len(raw)))
    flip_at = data.draw(st.integers(0, max(0, cut - 1)))
    flipped = bytearray(raw[:cut])
    if flipped:
        flipped[flip_at] = data.draw(st.integers(0, 255))
    for candidate in (raw[:cut], bytes(flipped)):
        try:
            safe_load(candidate)
        except UserError:
            pass
