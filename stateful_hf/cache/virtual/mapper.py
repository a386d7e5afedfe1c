"""vAttention's background page mapper: a daemon thread that maps ahead the device pages of the blocks
sessions will grow into next (`VirtualPool.prefetch`), so the step that allocates them maps nothing.

Owns: its thread and queue, and `error` (the last failed prefetch, which costs only the latency it
was to hide). Mutates the pool only through `prefetch`, under the pool's own guard. A registered
feature (`StoreFeature`): each step's commit submits its sessions' next blocks (under the store lock);
`stop` (the store's `close`) stops the thread, after which nothing is submitted.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

from ...kernels.blocks import blocks_for
from ..feature import StoreFeature
from ..sessions.session import SessionTable
from .pool import VirtualPool

if TYPE_CHECKING:
    from ..step import StepBatch


class PageMapper(StoreFeature):
    """vAttention's background mapper: a daemon thread that runs `pool.prefetch` for the blocks the
    next step will write, so the step's allocation finds them mapped. `submit` never blocks."""

    def __init__(self, pool: VirtualPool, sessions: SessionTable):
        self.pool, self.sessions, self.stopped = pool, sessions, False
        self._queue: queue.Queue[list[tuple[str, int]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="stateful-hf-page-mapper", daemon=True)
        self._thread.start()
        self.error: BaseException | None = None

    def submit(self, owners: list[tuple[str, int]]) -> None:
        if owners:
            self._queue.put(list(owners))

    def commit(self, step: StepBatch) -> None:
        """Submit (session, chunk) of the block each session of the step grows into next, once its last
        block is at least half full (or full)."""
        if self.stopped:
            return
        bs, out = self.pool.spec.block_size, []
        for sid in dict.fromkeys(e.session_id for e in step.entries):
            s = self.sessions.find(sid)
            if s is not None and (s.num_tokens % bs == 0 or s.num_tokens % bs >= bs // 2):
                out.append((sid, blocks_for(s.num_tokens, bs)))
        self.submit(out)

    def stop(self) -> None:
        """The store closes: the thread ends once what was submitted is mapped."""
        if not self.stopped:
            self.stopped = True
            self.close()

    def drain(self) -> None:
        """Wait until everything submitted so far is mapped (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (owners := self._queue.get()) is not None:
            try:
                self.pool.prefetch(owners)
            except BaseException as e:     # a failed prefetch costs only the latency it was to hide
                self.error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()
