"""Atomic writes, checksums and JSONL helpers shared by every stage.

Atomic commit follows the usual recipe: write to a temporary name in the same folder, flush and fsync the file,
``os.replace`` onto the final name, then fsync the folder so the rename itself is durable. A reader therefore sees
either the old file or the whole new one, never a torn write, even after ``kill -9`` or a power cut.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import DataError


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it are durable (no-op where the OS refuses)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on clean exit fsync it and rename it onto ``final``.

    The caller writes the file at the yielded path (closing it). On an exception the temporary file is removed and
    ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: Path) -> Any:
    """Read a JSON file; raises :class:`DataError` naming the file on a missing file or bad JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


class JsonlAppender:
    """Append records to a JSONL file durably, one line per record, resumable.

    Each ``append`` writes one complete line and fsyncs, so a crash loses at most the record being written. On open,
    a torn last line (no trailing newline, from a crash mid-write) is cut off so the file stays valid JSONL.
    """

    def __init__(self, path: Path, fsync_every: int = 1):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_jsonl_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._n = 0
        self._fsync_every = max(1, fsync_every)

    def append(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._n += 1
        if self._n % self._fsync_every == 0:
            self.flush()

    def flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        """Flush, fsync and close; the file is closed even when the flush fails (a full disk), which is raised."""
        if not self._f.closed:
            try:
                self.flush()
            finally:
                self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_jsonl(data: bytes) -> tuple[list[bytes], bytes]:
    """``(complete lines, torn tail)`` of a JSONL file's bytes. Every record Eyas appends ends with a newline, so
    bytes after the last newline are a line torn by a crash mid-write (``b""`` when there is none). Readers that
    must not modify the file skip or report the tail; :func:`repair_jsonl_tail` cuts it off."""
    lines = data.split(b"\n")
    return lines[:-1], lines[-1]


def repair_jsonl_tail(path: Path) -> None:
    """Cut a torn last line (no trailing newline, from a crash mid-write) off a JSONL file, durably (fsync)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        keep = f.read().rfind(b"\n") + 1
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)`` for each non-empty line of a JSONL file written by Eyas.

    Raises :class:`DataError` with ``file:line`` on a malformed line.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def sha256_bytes(*chunks: bytes) -> str:
    """Hex sha256 over the concatenation of ``chunks``."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def sha256_file(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def stable_hash(obj: Any, n: int = 16) -> str:
    """A short stable hex digest of a JSON-serialisable object (sorted keys): used for ids and fingerprints."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:n]
