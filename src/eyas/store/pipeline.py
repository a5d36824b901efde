"""Storing captured samples off the capture thread.

Validation, fp8 quantisation and checksums (:meth:`ShardWriter.prepare`) run in a thread pool; buffering
(:meth:`ShardWriter.append`) runs in one writer thread, in submission order, and each full shard is handed to a
small pool of commit threads (:meth:`ShardWriter.write`: write, fsync, rename, manifest line) while the next fills.
torch reductions, hashlib and file writes release the GIL, so the capture loop keeps the accelerator busy while
the previous batch is being stored. Memory in flight is bounded (``max_pending_bytes``): :meth:`put` waits when
the writer falls behind.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from .shards import ShardWriter


class BackgroundWriter:
    """Feed :class:`~eyas.capture.CapturedSample` objects to a :class:`ShardWriter` from a background thread.

    ``shard_bytes``: a shard is committed once this many bytes are buffered. :meth:`close` commits what is
    buffered and re-raises the first error (a :class:`~eyas.errors.StoreError` naming the sample, or an I/O error).
    Counters: ``samples``, ``tokens``, ``stored_bytes`` (tensor bytes, excluding safetensors headers).
    """

    def __init__(self, writer: ShardWriter, shard_bytes: int, workers: int | None = None,
                 max_pending_bytes: int = 2 << 30, commit_threads: int = 2):
        self.writer = writer
        self.shard_bytes = shard_bytes
        self.max_pending_bytes = max_pending_bytes
        self.pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1),
                                       thread_name_prefix="eyas-prepare")
        self.commit_threads = commit_threads
        self.committer = ThreadPoolExecutor(max_workers=commit_threads, thread_name_prefix="eyas-commit")
        self._commits: deque[Future] = deque()  # shards being written (at most commit_threads, bounding memory)
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.samples = self.tokens = self.stored_bytes = 0
        self._thread = threading.Thread(target=self._run, name="eyas-writer", daemon=True)
        self._thread.start()

    def put(self, cs) -> None:
        """Queue one captured sample (CPU tensors). Raises the writer's first error, if any, here."""
        if self.error is not None:
            raise self.error
        lab = cs.labels
        held = (cs.aux, cs.last) + ((lab.ids, lab.probs) if lab is not None else ())
        nbytes = sum(t.numel() * t.element_size() for t in held if t is not None)
        with self._cond:
            while self._pending_bytes > self.max_pending_bytes and self.error is None:
                self._cond.wait()
            self._pending_bytes += nbytes
        fut = self.pool.submit(self.writer.prepare, cs.sample_id, cs.input_ids, cs.aux, cs.last, cs.aux_scale,
                               cs.finite, cs.labels)
        self._queue.put((fut, nbytes))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, nbytes = item
            try:
                if self.error is None:
                    p = fut.result()
                    self.writer.append(p)
                    self.samples += 1
                    self.tokens += p.entry.tokens
                    self.stored_bytes += p.nbytes
                    if self.writer.buffered_bytes >= self.shard_bytes:
                        self._wait_commits(self.commit_threads - 1)
                        self._commits.append(self.committer.submit(self.writer.write, self.writer.take()))
            except BaseException as e:  # noqa: BLE001 - handed to the capture thread
                self.error = e
            finally:
                with self._cond:
                    self._pending_bytes -= nbytes
                    self._cond.notify_all()

    def _wait_commits(self, keep: int = 0) -> None:
        while len(self._commits) > keep:
            self._commits.popleft().result()  # raises a commit's error in the writer thread

    def close(self) -> None:
        """Wait for every queued sample, commit the buffered ones, close the manifest; re-raise the first error."""
        self._queue.put(None)
        self._thread.join()
        self.pool.shutdown()
        try:
            self._wait_commits()
        except BaseException as e:  # noqa: BLE001
            self.error = self.error or e
        self.committer.shutdown()
        try:
            self.writer.close()  # samples already validated are committed even when a later one failed
        except BaseException as e:  # noqa: BLE001 - after a failure (a full disk) this one fails too: keep the first
            if self.error is None:
                raise
        if self.error is not None:
            raise self.error
