"""A restricted unpickler for untrusted dumps (Flight Recorder traces, allocator snapshots).

`pickle.load` runs any callable a pickle names, so a dump copied off a compromised node could
run code on the on-call engineer's laptop. The dumps torch writes (`_dump_fr_trace()`,
`torch.cuda.memory._snapshot()`) are plain containers and scalars: they reference no global at
all (checked with pickletools on real H200 dumps). So this unpickler admits no global except the
few that the pickle protocol itself uses to encode plain data in old protocols, and refuses
everything else by name, before anything is called.

Size and work are bounded too:

- a file over `max_bytes` is refused from its size alone (never read), and no more than
  `max_bytes` are ever read (a file that grows meanwhile, a pipe);
- before anything is built, the opcodes are scanned against a work budget (`max_ops`): every
  opcode costs one, and so does every element hashed when a tuple or frozenset becomes a dict key
  or set member (shared parts counted each time), so that a few hundred bytes of tuples nested in
  tuples cannot make the loader hash 2^60 elements;
- the loaded structure must stay within `max_items` container items, *counting a shared container
  every time it is reached*: a 4 MB pickle can make a list of 2 million references to one dict,
  which code that walks it would pay for 2 million times.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from gpuvigil.errors import UserError

DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # a real snapshot of a full 141 GB device is tens of MB
# Container items reachable from the root, shared containers counted each time they are reached.
# A real 2,000-entry Flight Recorder dump is ~100k; a 50 KB H200 memory snapshot ~80k.
DEFAULT_MAX_ITEMS = 20_000_000
_CONTAINERS = (dict, list, tuple, set, frozenset)
# Opcodes, work units: one per opcode, plus hashing. A 2,000-entry Flight Recorder dump is ~100k.
DEFAULT_MAX_OPS = 50_000_000


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


class _BoundedReader:
    """A file the unpickler reads from, which refuses to give more than `limit` bytes (a file
    that grew after its size was checked, or a pipe)."""

    def __init__(self, fh: Any, limit: int, label: str):
        self._fh, self._left, self._limit, self._label = fh, limit, limit, label

    def _take(self, n: int) -> None:
        self._left -= n
        if self._left < 0:
            raise PickleReadError(f"{self._label}: more than the {self._limit}-byte limit for a pickle")

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(self._left + 1 if n is None or n < 0 else min(n, self._left + 1))
        self._take(len(data))
        return data

    def readline(self, n: int = -1) -> bytes:
        data = self._fh.readline(self._left + 1 if n is None or n < 0 else min(n, self._left + 1))
        self._take(len(data))
        return data

    def peek(self, n: int = 0) -> bytes:
        # With peek the C unpickler prefetches in large blocks instead of a call per opcode.
        return self._fh.peek(n)[: self._left + 1]

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf)
        n = self._fh.readinto(view[: self._left + 1])
        self._take(n or 0)
        return n or 0


def _open(source: bytes | bytearray | str | Path, max_bytes: int) -> tuple[Any, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        label = "<bytes>"
        if len(source) > max_bytes:
            raise PickleReadError(f"{label}: {len(source)} bytes is larger than the {max_bytes}-byte limit for a pickle")
        if not source:
            raise PickleReadError(f"{label}: empty file, not a pickle")
        return io.BytesIO(bytes(source)), label
    path = Path(source)
    label = str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:  # refused from its size: not a byte of it is read
            raise PickleReadError(f"{label}: {size} bytes is larger than the {max_bytes}-byte limit for a pickle")
        if size == 0 and path.is_file():
            raise PickleReadError(f"{label}: empty file, not a pickle")
        fh = path.open("rb")
    except OSError as exc:
        raise PickleReadError(f"{label}: cannot read: {exc.strerror or exc}") from exc
    return fh, label


# The opcode table the scanner needs: byte -> (kind, argument). Argument: an int n = n bytes; "L1",
# "L4", "L8" = a length prefix of that many bytes, then that many bytes; "nl" = up to a newline;
# "nl2" = two lines. Kinds say what the opcode does to the stack.
_OPS: dict[int, tuple[str, Any]] = {}
for _kind, _ops in {
    "scalar": [("F", "nl"), ("I", "nl"), ("J", 4), ("K", 1), ("L", "nl"), ("M", 2), ("N", 0), ("S", "nl"), ("T", "L4"), ("U", "L1"),
               ("V", "nl"), ("X", "L4"), ("G", 8), ("\x88", 0), ("\x89", 0), ("\x8a", "L1"), ("\x8b", "L4"), ("B", "L4"), ("C", "L1"),
               ("\x8c", "L1"), ("\x8d", "L8"), ("\x8e", "L8"), ("\x96", "L8"), ("\x97", 0), (")", 0)],
    "mutable": [("]", 0), ("}", 0), ("\x8f", 0)],
    "get": [("g", "nl"), ("h", 1), ("j", 4)],
    "put": [("p", "nl"), ("q", 1), ("r", 4), ("\x94", 0)],
    "nop": [("\x80", 1), ("\x95", 8), ("\x98", 0), (".", 0)],
}.items():
    for _ch, _arg in _ops:
        _OPS[ord(_ch)] = (_kind, _arg)
for _ch, _kind in {"(": "mark", "0": "pop", "1": "pop_mark", "2": "dup", "a": "append", "e": "appends", "u": "setitems",
                   "\x90": "additems", "s": "setitem", "t": "tuple", "\x91": "frozenset", "l": "list", "d": "dict",
                   "\x85": "tuple1", "\x86": "tuple2", "\x87": "tuple3", "R": "reduce"}.items():
    _OPS[ord(_ch)] = (_kind, 0)
# Opcodes the loader refuses by name (globals, objects, persistent ids): (argument, pops, pushes);
# pops -1 = everything down to the MARK.
_OTHER: dict[int, tuple[Any, int, int]] = {
    ord("c"): ("nl2", 0, 1), ord("\x93"): (0, 2, 1), ord("i"): ("nl2", -1, 1), ord("o"): (0, -1, 1), ord("\x81"): (0, 2, 1),
    ord("\x92"): (0, 3, 1), ord("P"): ("nl", 0, 1), ord("Q"): (0, 1, 1), ord("b"): (0, 1, 0),
    ord("\x82"): (1, 0, 1), ord("\x83"): (2, 0, 1), ord("\x84"): (4, 0, 1),
}
_MARK = object()


def _size(x: Any) -> int:
    return x if type(x) is int else x[0]


def scan(data: bytes | memoryview, max_ops: int, label: str = "<pickle>") -> int:
    """Walk the opcodes of `data` without building anything; return the work they stand for and
    raise `PickleReadError` once it passes `max_ops`. Work: one per opcode, plus one per element
    hashed (tuples and frozensets made dict keys or set members, shared parts counted each time).
    The stack holds sizes: an int for an immutable value (exact: a tuple cannot change), a
    one-element list for a list/dict/set, shared through the memo as the object would be."""
    scanner = _Scanner(data, label)
    try:
        return scanner.run(max_ops)
    except PickleReadError:
        raise
    except (IndexError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise scanner.bad(f"{type(exc).__name__} while scanning") from None


class _Scanner:
    """The state of one `scan`: the data, the stack of sizes and the memo."""

    def __init__(self, data: bytes | memoryview, label: str):
        self.buf = memoryview(data)
        self.end = len(self.buf)
        self.stack: list[Any] = []
        self.memo: dict[Any, Any] = {}
        self.label = label

    def bad(self, why: str) -> PickleReadError:
        return PickleReadError(f"{self.label}: not a valid pickle ({why})")

    def run(self, max_ops: int) -> int:
        buf, end, stack = self.buf, self.end, self.stack
        push, build, memo_op, other, skip = stack.append, self.build, self.memo_op, self.other, self.skip
        work = 0
        pos = 0
        while pos < end:
            code = buf[pos]
            pos += 1
            work += 1
            entry = _OPS.get(code)
            if entry is None:
                pos = other(code, pos)
                continue
            kind, arg = entry
            # The common opcodes first, with fixed-size arguments read in place.
            if kind == "scalar":
                if arg:
                    if type(arg) is int:
                        pos += arg
                    else:
                        pos, _ = skip(arg, pos)
                push(1)
            elif kind == "put" or kind == "get":
                pos = memo_op(kind, arg, pos)
            elif kind == "nop":
                if code == 0x2E:  # STOP
                    break
                pos += arg
            else:
                work += build(kind)
            if pos > end:
                raise self.bad("argument past the end of the data")
            if work > max_ops:
                raise PickleReadError(f"{self.label}: more than {max_ops} units of work to unpickle; refused (not a dump torch writes)")
        return work

    def to_mark(self) -> list[Any]:
        stack = self.stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise self.bad("no MARK on the stack")

    def skip(self, arg: Any, at: int) -> tuple[int, bytes]:
        buf = self.buf
        if type(arg) is int:
            return at + arg, bytes(buf[at : at + arg])
        if arg == "nl" or arg == "nl2":
            nxt = bytes(buf[at : at + 256 * 1024]).find(b"\n")
            if nxt < 0:
                raise self.bad("unterminated line argument")
            line = bytes(buf[at : at + nxt])
            at += nxt + 1
            if arg == "nl2":
                at, _ = self.skip("nl", at)
            return at, line
        n = {"L1": 1, "L4": 4, "L8": 8}[arg]
        length = int.from_bytes(buf[at : at + n], "little", signed=(arg == "L4"))
        if length < 0 or at + n + length > self.end:
            raise self.bad("length past the end of the data")
        return at + n + length, b""

    def other(self, code: int, pos: int) -> int:
        """An opcode the scan only steps over: its argument skipped, its stack effect applied."""
        other = _OTHER.get(code)
        if other is None:
            raise self.bad(f"unknown opcode 0x{code:02x}")
        arg, pops, pushes = other
        pos, _ = self.skip(arg, pos)
        if pops < 0:
            self.to_mark()
        elif pops:
            if len(self.stack) < pops:
                raise self.bad("stack underflow")
            del self.stack[-pops:]
        self.stack.extend([1] * pushes)
        return pos

    def memo_op(self, kind: str, arg: Any, pos: int) -> int:
        """PUT (store the top of the stack) or GET (push what was stored), keyed as the opcode says."""
        buf, stack, memo = self.buf, self.stack, self.memo
        if kind == "put":
            if arg == 0:
                memo[len(memo)] = stack[-1]
            elif arg == "nl":
                pos, line = self.skip(arg, pos)
                memo[line.strip()] = stack[-1]
            else:
                memo[int.from_bytes(buf[pos : pos + arg], "little")] = stack[-1]
                pos += arg
        elif arg == "nl":
            pos, line = self.skip(arg, pos)
            stack.append(memo[line.strip()])
        else:
            stack.append(memo[int.from_bytes(buf[pos : pos + arg], "little")])
            pos += arg
        return pos

    def build(self, kind: str) -> int:
        """An opcode that builds or fills a container, or moves the stack; returns the work of
        hashing what becomes a dict key or a set member."""
        stack = self.stack
        work = 0
        push = stack.append
        if kind == "mark":
            push(_MARK)
        elif kind == "setitems" or kind == "appends" or kind == "additems":
            items = self.to_mark()
            total = 0
            for v in items:
                total += v if type(v) is int else v[0]
            if kind != "appends":
                work += total if kind == "additems" else sum(_size(k) for k in items[0::2])
            stack[-1][0] += total
        elif kind == "mutable":
            push([1])
        elif kind == "append":
            v = stack.pop()
            stack[-1][0] += _size(v)
        elif kind == "setitem":
            v, k = stack.pop(), stack.pop()
            work += _size(k)
            stack[-1][0] += _size(k) + _size(v)
        elif kind == "tuple1" or kind == "tuple2" or kind == "tuple3":
            k = int(kind[-1])
            if len(stack) < k:
                raise self.bad("stack underflow")
            n = 1 + sum(_size(v) for v in stack[-k:])
            del stack[-k:]
            push(n)
        elif kind in ("tuple", "frozenset", "list", "dict"):
            items = self.to_mark()
            n = 1 + sum(_size(v) for v in items)
            if kind in ("frozenset", "dict"):
                work += n
            push(n if kind in ("tuple", "frozenset") else [n])
        elif kind == "reduce":
            args = stack.pop()
            stack.pop()
            work += _size(args)  # the admitted callables (set, frozenset) hash their argument
            push([_size(args)])
        elif kind == "pop":
            stack.pop()
        elif kind == "pop_mark":
            self.to_mark()
        elif kind == "dup":
            push(stack[-1])
        return work


def check_items(obj: Any, max_items: int, label: str = "<pickle>") -> int:
    """The container items reachable from `obj`, a shared container counted each time it is
    reached (what code that walks the structure pays); raise `PickleReadError` when that passes
    `max_items`, or for a cycle (a walk would never end). Each distinct container is visited once
    (sizes are summed bottom-up), so this costs the pickle's size, not the count it bounds."""
    sizes: dict[int, int] = {}
    started: set[int] = set()
    stack: list[tuple[Any, bool]] = [(obj, False)]

    def children(o: Any) -> Any:
        if isinstance(o, dict):
            return [c for c in o.values() if isinstance(c, _CONTAINERS)] + [k for k in o if isinstance(k, tuple | frozenset)]
        return [c for c in o if isinstance(c, _CONTAINERS)]

    while stack:
        o, done = stack.pop()
        i = id(o)
        if done:
            total = len(o) + sum(sizes[id(c)] for c in children(o))
            if total > max_items:
                raise PickleReadError(
                    f"{label}: more than {max_items} items once shared parts are counted each time they are used; "
                    "refused (not a dump torch writes)"
                )
            sizes[i] = total
            started.discard(i)
            continue
        if i in sizes:
            continue
        if i in started:
            raise PickleReadError(f"{label}: a container that contains itself; refused (not a dump torch writes)")
        started.add(i)
        stack.append((o, True))
        stack.extend((c, False) for c in children(o) if id(c) not in sizes)
    return sizes[id(obj)]


def safe_load(
    source: bytes | bytearray | str | Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_items: int = DEFAULT_MAX_ITEMS,
    max_ops: int = DEFAULT_MAX_OPS,
) -> Any:
    """Unpickle plain data from a file path or bytes; refuse every global that is not plain data,
    files over `max_bytes`, opcode streams over `max_ops` units of work, and structures over
    `max_items` (see the module docstring).

    Raises `UnsafePickleError` naming the refused global, or `PickleReadError` for a file that is
    unreadable, too large, too much work, truncated or not a pickle. Both are `UserError`s.
    """
    fh, label = _open(source, max_bytes)
    try:
        with fh:
            data = _BoundedReader(fh, max_bytes, label).read()
        scan(data, max_ops, label)
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except (UnsafePickleError, PickleReadError) as exc:
        raise type(exc)(str(exc) if str(exc).startswith(label) else f"{label}: {exc}") from None
    except RecursionError:
        raise PickleReadError(f"{label}: pickle nests too deeply") from None
    except MemoryError:
        raise PickleReadError(f"{label}: pickle needs too much memory") from None
    except Exception as exc:  # noqa: BLE001 - any failure of the C unpickler on hostile bytes is bad input
        raise PickleReadError(f"{label}: not a valid pickle ({type(exc).__name__}: {str(exc)[:120]})") from None
    if isinstance(obj, _CONTAINERS):
        check_items(obj, max_items, label)
    return obj


def looks_like_pickle(head: bytes) -> bool:
    """Cheap format sniffing: a protocol 2+ pickle starts with PROTO (0x80) and its version."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
