"""One writer per run folder (issue 19): a command that writes a run folder holds ``RUN/writer.lock`` while it runs.

Two commands writing one run folder at once (a retried job, a second terminal) interleave their outputs: two
extractions resumed the same partial store and both appended to it, two trainings logged the same steps twice. So
every command that writes a stage folder (the stage commands, ``eyas run``, ``eyas doctor --repair``) takes the lock
where the CLI dispatches it, before anything is written, and a second command is refused with
:class:`RunFolderBusy`, naming the holder (pid, host, command, since when). Read-only commands (``eyas doctor``
without ``--repair``, ``plan``, ``report``, ``show-config``, ``export --check``) never touch the lock.

The lock is an ``fcntl.flock`` on ``RUN/writer.lock``: the kernel drops it when the holding process ends, however
it ends (``kill -9`` included), so a dead command never leaves a run locked. The file holds the holder's details as
JSON (``cat RUN/writer.lock``) and is deleted when the lock is released; a file left by a killed holder is taken
over by the next command. A process forked while the lock is held (a DataLoader worker, an engine process) closes
its copy of the descriptor, so only the command itself holds the lock.

torchrun: the processes of one job are one writer. Global rank 0 takes the lock and records the job
(``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR:MASTER_PORT`` and the restart count, which no two jobs running at once
share); every other rank waits until the lock names its own job, and is refused when it names another (a second job
is refused on every rank before any rank writes). The run folder must be on a file system all nodes share, as it
must be for a data-parallel store.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .errors import DiskFullError, EyasError, is_disk_full
from .run_folder import RunFolder

try:
    import fcntl
except ImportError:   # not a POSIX system: commands run unlocked, with a warning (acquire)
    fcntl = None

# descriptors of locks this process holds: a forked child closes its copies (see _close_in_child)
_HELD: set[int] = set()


def _close_in_child() -> None:
    # Closing a duplicated descriptor does not release a flock while the parent still holds its own (flock(2));
    # LOCK_UN would release it for both, so the child only closes.
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class RunFolderBusy(EyasError):
    """Another process holds the run folder's writer lock (or, on a torchrun rank, another job does)."""


@dataclass(frozen=True)
class Job:
    """The torchrun job this process belongs to: ``key`` is shared by its processes and by no other job running
    at the same time; ``rank`` and ``world`` as torchrun numbers them."""

    key: str
    rank: int
    world: int


def torchrun_job(env: dict[str, str] | None = None) -> Job | None:
    """This process's torchrun job (``WORLD_SIZE`` > 1, as :meth:`eyas.distributed.Dist.from_env` decides), or
    ``None`` for a single process. The key joins ``TORCHELASTIC_RUN_ID`` (a fresh uuid for a one-node torchrun
    without ``--master-port``, the user's ``--rdzv-id`` otherwise), ``MASTER_ADDR:MASTER_PORT`` (no two running jobs
    can bind the same) and ``TORCHELASTIC_RESTART_COUNT`` (a restarted worker group takes the lock anew)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    key = (f"{env.get('TORCHELASTIC_RUN_ID', 'none')}@{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
           f"/restart-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    return Job(key, int(env.get("RANK", "0")), world)


@dataclass(frozen=True)
class Holder:
    """What ``RUN/writer.lock`` says about the process holding it. ``since``: seconds since the epoch."""

    pid: int
    host: str
    command: str
    since: float
    job: str | None = None
    world: int = 1

    def describe(self) -> str:
        """``pid 12 on host, `eyas extract my.yaml`, since 2026-12-02 10:11:12 (3 min ago)``."""
        ago = max(0.0, time.time() - self.since)
        ago_s = f"{ago:.0f} s" if ago < 120 else f"{ago / 60:.0f} min" if ago < 7200 else f"{ago / 3600:.1f} h"
        job = f" (rank 0 of torchrun job {self.job}, {self.world} processes)" if self.job else ""
        gone = ""
        if self.host == socket.gethostname() and not _alive(self.pid):
            gone = (" (that process has ended, but a process it started still holds the lock: `fuser -v "
                    "RUN/writer.lock` names it)")
        return (f"pid {self.pid} on {self.host}{job}, `{self.command}`, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))} ({ago_s} ago){gone}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(run: RunFolder) -> Holder | None:
    """The holder ``RUN/writer.lock`` names, ``None`` when there is no such file or it is empty or unreadable (a
    holder that has just taken the lock writes it a moment later). Does not lock, so a file left by a killed
    holder is read too: only a failed :func:`acquire` says that someone holds the lock."""
    try:
        d = json.loads(run.writer_lock.read_text(encoding="utf-8"))
        return Holder(int(d["pid"]), str(d["host"]), str(d["command"]), float(d["since"]), d.get("job"),
                      int(d.get("world", 1)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _busy(run: RunFolder, holder: Holder | None, who: str = "") -> RunFolderBusy:
    desc = holder.describe() if holder else "a process that has not written its details yet"
    return RunFolderBusy(
        f"{run.root} is being written by another Eyas command{who}: {desc}. One command writes a run folder at a "
        f"time: wait for that one to end (or stop it), or give this command another run_dir. Read-only commands "
        f"(eyas doctor without --repair, eyas plan, eyas report) can run meanwhile; the lock ({run.writer_lock}) "
        f"is released when that process ends, even if it is killed.")


def _holder_soon(run: RunFolder, wait_s: float = 2.0) -> Holder | None:
    deadline = time.monotonic() + wait_s
    while (h := read_holder(run)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return h


def _command(argv: list[str]) -> str:
    """The command line as a user typed it: ``python -m eyas.cli extract my.yaml`` (under torchrun too) and the
    ``eyas`` script both read as ``eyas extract my.yaml``."""
    if argv and Path(argv[0]).name in ("eyas", "cli.py"):
        return shlex.join(["eyas", *argv[1:]])
    return shlex.join(argv)


class WriterLock:
    """The run folder's lock, held by this process (:func:`hold_run_folder` makes and releases it)."""

    def __init__(self, run: RunFolder, fd: int, made: list[Path]):
        self.run, self.fd, self._made = run, fd, made

    def release(self) -> None:
        """Delete ``writer.lock`` (while still holding it, so no one is left locking a deleted file unknowingly),
        unlock, and remove the run folders this command created if nothing else was written in them."""
        try:
            st, fst = os.stat(self.run.writer_lock), os.fstat(self.fd)
            if (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
                self.run.writer_lock.unlink()
        except OSError:
            pass
        _HELD.discard(self.fd)
        os.close(self.fd)
        for d in self._made:   # deepest first; a refused command leaves no empty run folder behind
            try:
                d.rmdir()
            except OSError:
                break


def acquire(run: RunFolder, argv: list[str], job: Job | None = None,
            log: Callable[[str], None] = print) -> WriterLock | None:
    """Take ``RUN/writer.lock`` for this process (creating the run folder if needed) and record the holder in it.

    Returns ``None``, with a warning, where the file system cannot lock (then nothing stops a second writer).
    Raises :class:`RunFolderBusy` naming the holder when another process holds it.
    """
    if fcntl is None:
        log(f"[eyas] warning: no file locks on this system: nothing stops a second command from writing {run.root} "
            f"at the same time")
        return None
    made = []
    p = run.root.absolute()
    while not p.exists():
        made.append(p)
        p = p.parent
    path = run.writer_lock
    while True:
        try:
            run.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            kind = DiskFullError if is_disk_full(e) else EyasError
            raise kind(f"cannot write the run folder {run.root}: {e.strerror} ({path}); free space or fix its "
                       f"permissions, or give another run_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _busy(run, _holder_soon(run)) from None
            log(f"[eyas] warning: cannot lock {path} ({e.strerror}; the file system does not support locks): "
                f"nothing stops a second command from writing {run.root} at the same time")
            return None
        try:   # a holder releasing the lock deletes the file: locking the deleted file would lock nothing
            st, fst = os.stat(path), os.fstat(fd)
            same = (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    holder = Holder(os.getpid(), socket.gethostname(), _command(argv), time.time(),
                    job.key if job else None, job.world if job else 1)
    data = (json.dumps(asdict(holder)) + "\n").encode()
    _HELD.add(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except OSError as e:   # a full disk: the lock holds all the same, only a refused command learns less
        log(f"[eyas] warning: could not record this command in {path} ({e.strerror}); it holds the lock all the same")
    return WriterLock(run, fd, made)


def await_job_holder(run: RunFolder, job: Job, wait_s: float = 120.0, other_s: float = 5.0) -> None:
    """On a torchrun rank other than 0: return once ``RUN/writer.lock`` names this rank's job (its rank 0 holds
    it). Raises :class:`RunFolderBusy` when it names another holder for ``other_s`` seconds (this job's rank 0
    would have taken it over by then), or no holder of this job appears within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    other_since = None
    host = socket.gethostname()
    while True:
        h = read_holder(run)
        if h is not None and h.job == job.key and (h.host != host or _alive(h.pid)):
            return
        now = time.monotonic()
        other_since = (other_since or now) if h is not None else None
        if now >= deadline or (other_since is not None and now - other_since >= other_s):
            raise _busy(run, h, f" (rank {job.rank} of torchrun job {job.key} found the lock held by another "
                                f"process, not by its rank 0)") if h is not None else RunFolderBusy(
                f"rank {job.rank} of torchrun job {job.key}: rank 0 did not take {run.writer_lock} within "
                f"{wait_s:.0f} s, so this rank writes nothing; see rank 0's output")
        time.sleep(0.05)


@contextmanager
def hold_run_folder(run: RunFolder, argv: list[str], log: Callable[[str], None] = print,
                    env: dict[str, str] | None = None) -> Iterator[None]:
    """Hold the run folder's writer lock for the body: the one writer of ``run``. Under torchrun rank 0 takes it
    for the job and the other ranks check that it did (:func:`await_job_holder`). Raises :class:`RunFolderBusy`
    before the body runs when another command (or another torchrun job) writes ``run``."""
    job = torchrun_job(env)
    if job is not None and job.rank != 0:
        await_job_holder(run, job)
        yield
        return
    lock = acquire(run, argv, job, log)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
