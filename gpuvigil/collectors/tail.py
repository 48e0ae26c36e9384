"""The one way gpuvigil follows a growing file: kernel log files, torch/NCCL logs, hook JSONL.

`FileTail` behaves like `tail -F`:

- it keeps the file open between reads, so what was appended just before the file was rotated
  (renamed away) or replaced (a new file renamed over it) is still read from the old file before
  switching to the new one — nothing is lost across a rotation or an atomic replace;
- truncation in place (logrotate's `copytruncate`) restarts at the top;
- a read is capped (`max_read_bytes`): a runaway writer cannot stall the pipeline, the rest is
  read on the next call;
- only whole lines are returned; a partial last line waits for its newline, and a "line" longer
  than `max_line_bytes` is dropped (counted in `dropped_lines`) rather than held in memory;
- it starts at the beginning or at the end of the file, or at a saved `TailPosition` (device,
  inode, offset) when the same file is still there, so a restart resumes where it stopped.

`TailSet` follows a set of paths, directories (`*.jsonl` / `*.log` inside) and globs, picking up
files that appear later (read from their start: they are new).
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas

DEFAULT_MAX_READ_BYTES = 8 << 20
DEFAULT_MAX_LINE_BYTES = 1 << 20


@dataclass(frozen=True)
class TailPosition:
    """Where a tail stopped: the file's identity and the offset of the first unread byte."""

    dev: int
    ino: int
    offset: int

    def to_json(self) -> dict[str, int]:
        return {"dev": self.dev, "ino": self.ino, "offset": self.offset}

    @classmethod
    def from_json(cls, data: Any) -> TailPosition | None:
        try:
            return cls(int(data["dev"]), int(data["ino"]), int(data["offset"]))
        except (KeyError, TypeError, ValueError):
            return None


class FileTail:
    """Follows one file; see the module docstring. A missing file is quiet (it may appear);
    one that cannot be read (permission, a directory) raises OSError."""

    def __init__(
        self,
        path: str | Path,
        *,
        from_start: bool = True,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        position: TailPosition | None = None,
    ):
        if max_read_bytes <= 0 or max_line_bytes <= 0:
            raise ValueError("max_read_bytes and max_line_bytes must be > 0")
        self.path = Path(path)
        self.from_start = from_start
        self.max_read_bytes = max_read_bytes
        self.max_line_bytes = max_line_bytes
        self.lines_read = 0
        self.dropped_lines = 0
        self.rotations = 0
        self._resume = position
        self._fh: Any = None
        self._partial = b""
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self._tried_open = False
        self._old: Any = None  # the rotated-away file, drained before the new one
        if not from_start or position is not None:
            # Position now, not at the first read: lines written between start-up and the first
            # tick are new, not history.
            self._tried_open = True
            self._open(first=True)

    # -- state ----------------------------------------------------------------------------

    @property
    def position(self) -> TailPosition | None:
        """The resume point (start of the pending partial line), or None before the first open."""
        fh = self._old or self._fh
        if fh is None:
            return None
        st = os.fstat(fh.fileno())
        return TailPosition(st.st_dev, st.st_ino, fh.tell() - len(self._partial))

    def close(self) -> None:
        for fh in (self._old, self._fh):
            if fh is not None:
                fh.close()
        self._old = self._fh = None

    # -- reading ----------------------------------------------------------------------------

    def _open(self, *, first: bool) -> bool:
        try:
            # O_NONBLOCK: a FIFO or device under a log's name must not hang the pipeline.
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return False  # not there (yet): quiet, it may appear
        # Anything else (permission denied, a directory) is an error the caller reports.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(self.path))
        fh = os.fdopen(fd, "rb")
        self._fh = fh
        if first:
            st = os.fstat(fh.fileno())
            resume = self._resume
            if resume is not None and (resume.dev, resume.ino) == (st.st_dev, st.st_ino) and resume.offset <= st.st_size:
                fh.seek(resume.offset)
            elif resume is not None:
                pass  # replaced while we were away: the file there now is new, read it all
            elif not self.from_start:
                fh.seek(0, os.SEEK_END)
        return True

    def _check_replaced(self) -> None:
        """Switch to the file now at `path` when ours was rotated/replaced; handle truncation."""
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        fst = os.fstat(self._fh.fileno())
        if st is None or (st.st_ino, st.st_dev) != (fst.st_ino, fst.st_dev):
            if st is None:
                return  # gone for now (mid-rotation): keep reading the open file
            # Keep the old file to drain what was appended before the rename.
            self._old, self._fh = self._fh, None
            self.rotations += 1
            self._open(first=False)
        elif fst.st_size < self._fh.tell():
            # Truncated in place (copytruncate): start again from the top.
            self._fh.seek(0)
            self._partial, self._skipping = b"", False

    def _read_capped(self, budget: int) -> list[bytes]:
        chunks: list[bytes] = []
        if self._old is not None:
            data = self._old.read(budget)
            chunks.append(data)
            budget -= len(data)
            if budget <= 0:
                return chunks  # still draining the old file; the new one waits
            self._old.close()
            self._old = None
            # The new file starts a new line whatever the old one ended with.
            tail = (self._partial + data)[-1:]
            if (tail and tail != b"\n") or (not data and self._partial):
                chunks.append(b"\n")
            if self._fh is None:
                self._open(first=False)
        if self._fh is not None and budget > 0:
            chunks.append(self._fh.read(budget))
        return chunks

    def read_raw_lines(self) -> list[bytes]:
        """New complete lines as bytes, without their newline."""
        if self._fh is None and self._old is None:
            first = not self._tried_open
            self._tried_open = True
            # A file missing at the first try is new when it appears: read it from its start.
            if not self._open(first=first):
                return []
        elif self._old is None:
            self._check_replaced()
        data = b"".join(self._read_capped(self.max_read_bytes))
        if not data:
            return []
        if self._skipping:
            nl = data.find(b"\n")
            if nl < 0:
                return []
            data, self._skipping = data[nl + 1 :], False
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > self.max_line_bytes:
            self.dropped_lines += 1
            self._partial, self._skipping = b"", True
        out = []
        for raw in complete:
            if len(raw) > self.max_line_bytes:
                self.dropped_lines += 1
                continue
            out.append(raw)
        self.lines_read += len(out)
        return out

    def read_lines(self) -> list[str]:
        """New complete lines; invalid UTF-8 is replaced, never fatal."""
        return [raw.decode("utf-8", errors="replace") for raw in self.read_raw_lines()]


class TailSet:
    """Follows many files: explicit paths, directories (files matching `suffixes`) and globs.

    Files found at the first scan start per `from_start`; files that appear later are read
    from their start. A file whose path is gone is kept until its open handle is drained.
    """

    def __init__(
        self,
        paths: Iterable[str | Path],
        *,
        from_start: bool = True,
        suffixes: tuple[str, ...] = (".jsonl",),
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ):
        self.patterns = [str(p) for p in paths]
        self.from_start = from_start
        self.suffixes = suffixes
        self.max_read_bytes = max_read_bytes
        self.max_line_bytes = max_line_bytes
        self.tails: dict[Path, FileTail] = {}
        self._scanned = False
        self._dropped_closed = 0  # over-long lines of files no longer followed
        self.failures: dict[Path, str] = {}  # files the latest read could not read, with why

    def _discover(self) -> list[Path]:
        found: list[Path] = []
        for pattern in self.patterns:
            p = Path(pattern)
            if p.is_dir():
                found.extend(sorted(f for f in p.iterdir() if f.name.endswith(self.suffixes) and f.is_file()))
            elif glob.has_magic(pattern):
                found.extend(Path(f) for f in sorted(glob.glob(pattern)) if Path(f).is_file())
            else:
                found.append(p)  # an explicit file: followed even before it exists
        return found

    def read(self) -> list[tuple[Path, list[bytes]]]:
        """New complete lines (bytes) per file, in a stable order; unreadable files are listed
        in `failures` instead."""
        first_scan = not self._scanned
        self._scanned = True
        self.failures = {}
        for path in self._discover():
            if path not in self.tails:
                try:
                    self.tails[path] = FileTail(
                        path,
                        from_start=self.from_start or not first_scan,
                        max_read_bytes=self.max_read_bytes,
                        max_line_bytes=self.max_line_bytes,
                    )
                except OSError as exc:
                    self.failures[path] = f"cannot read {path}: {exc.strerror or exc}"
        out = []
        for path, tail in list(self.tails.items()):
            try:
                lines = tail.read_raw_lines()
            except OSError as exc:  # one unreadable file does not hide the others
                self.failures[path] = f"cannot read {path}: {exc.strerror or exc}"
                continue
            if lines:
                out.append((path, lines))
            elif not path.exists():
                # Deleted and drained (a finished job's file): release its handle.
                self._dropped_closed += tail.dropped_lines
                tail.close()
                del self.tails[path]
        return out

    @property
    def dropped_lines(self) -> int:
        return self._dropped_closed + sum(t.dropped_lines for t in self.tails.values())

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()





class TailingLogCollector:
    """Base of the collectors that tail one log file: new lines each tick → `events`.

    Subclasses say how lines become events (`events_from`) and set `name`, `errors` and `tail`;
    reading, rotation, error counting and the target's health are here once. A line that cannot
    be parsed is counted in `errors`, never raised.
    """

    name: str
    errors: int
    tail: FileTail
    last_error: str | None = None

    streams: Mapping[str, pl.Schema] = {"events": schemas.EVENTS}

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        raise NotImplementedError

    def health(self) -> dict[str, str | None]:
        """This tick's read of the file: None when it worked (a missing file is not an error)."""
        return {str(self.tail.path): self.last_error}

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        first = self.tail.lines_read + 1
        try:
            lines = self.tail.read_lines()
            self.last_error = None
        except OSError as exc:
            self.errors += 1
            self.last_error = f"cannot read {self.tail.path}: {exc.strerror or exc}"
            return {}
        if not lines:
            return {}
        try:
            ev = self.events_from(lines, first)
        except (ValueError, OverflowError, schemas.SchemaError):
            self.errors += 1
            return {}
        return {"events": ev} if ev.height else {}
__all__ = ["DEFAULT_MAX_LINE_BYTES", "DEFAULT_MAX_READ_BYTES", "FileTail", "TailPosition", "TailSet", "TailingLogCollector"]
