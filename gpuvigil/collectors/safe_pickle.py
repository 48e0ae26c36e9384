"""A restricted unpickler for untrusted dumps (Flight Recorder traces, allocator snapshots).

`pickle.load` runs any callable a pickle names, so a dump copied off a compromised node could
run code on the on-call engineer's laptop. The dumps torch writes (`_dump_fr_trace()`,
`torch.cuda.memory._snapshot()`) are plain containers and scalars: they reference no global at
all (checked with pickletools on real H200 dumps). So this unpickler admits no global except the
few that the pickle protocol itself uses to encode plain data in old protocols, and refuses
everything else by name, before anything is called.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from gpuvigil.errors import UserError

DEFAULT_MAX_BYTES = 512 * 1024 * 1024  # a real snapshot of a full 141 GB device is tens of MB


class UnsafePickleError(UserError):
    """The pickle references a global (a callable or class) that is not plain data."""


class PickleReadError(UserError):
    """The input is not a readable pickle (truncated, corrupt, too large)."""


def _latin1_bytes(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    # Protocols 0-2 encode `bytes` as `_codecs.encode(str, "latin1")`. Any other codec
    # (zlib_codec, bz2_codec...) would turn a small file into a decompression bomb.
    if encoding not in ("latin1", "latin-1") or errors != "strict" or not isinstance(text, str):
        raise UnsafePickleError(f"refused _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _bytearray_from_data(data: Any = b"", *rest: Any) -> bytearray:
    # bytearray(N) would allocate N zero bytes: a 10-byte pickle asking for a terabyte.
    if not isinstance(data, (bytes, str)) or len(rest) > 1:
        raise UnsafePickleError("refused bytearray built from a size instead of data")
    return bytearray(data, *rest) if isinstance(data, str) else bytearray(data)


# Globals that only rebuild plain containers from plain arguments (protocols 0-2 need them for
# set/frozenset/bytearray/bytes, which newer protocols encode with dedicated opcodes).
_ADMITTED: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): _bytearray_from_data,
    ("__builtin__", "set"): set,
    ("__builtin__", "frozenset"): frozenset,
    ("__builtin__", "bytearray"): _bytearray_from_data,
    ("_codecs", "encode"): _latin1_bytes,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ADMITTED[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"refused global {module}.{name} (only plain containers and scalars are admitted)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused persistent id (only plain containers and scalars are admitted)")


def _read(source: bytes | bytearray | str | Path, max_bytes: int) -> tuple[bytes, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        label = "<bytes>"
    else:
        path = Path(source)
        label = str(path)
        try:
            size = path.stat().st_size
            if size > max_bytes:
                raise PickleReadError(f"{label}: {size} bytes is larger than the {max_bytes}-byte limit for a pickle")
            with path.open("rb") as fh:
                data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise PickleReadError(f"{label}: cannot read: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise PickleReadError(f"{label}: {len(data)} bytes is larger than the {max_bytes}-byte limit for a pickle")
    return data, label


def safe_load(source: bytes | bytearray | str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Unpickle plain data from a file path or bytes; refuse every global that is not plain data.

    Raises `UnsafePickleError` naming the refused global, or `PickleReadError` for a file that is
    unreadable, too large, truncated or not a pickle. Both are `UserError`s.
    """
    data, label = _read(source, max_bytes)
    if not data:
        raise PickleReadError(f"{label}: empty file, not a pickle")
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as exc:
        raise UnsafePickleError(f"{label}: {exc}") from None
    except RecursionError:
        raise PickleReadError(f"{label}: pickle nests too deeply") from None
    except MemoryError:
        raise PickleReadError(f"{label}: pickle needs too much memory") from None
    except Exception as exc:  # noqa: BLE001 - any failure of the C unpickler on hostile bytes is bad input
        raise PickleReadError(f"{label}: not a valid pickle ({type(exc).__name__}: {str(exc)[:120]})") from None


def looks_like_pickle(head: bytes) -> bool:
    """Cheap format sniffing: a protocol 2+ pickle starts with PROTO (0x80) and its version."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
