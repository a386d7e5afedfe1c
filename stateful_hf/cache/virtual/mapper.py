"""vAttention's background page mapper: a daemon thread that maps ahead the device pages of the blocks
sessions will grow into next (`VirtualPool.prefetch`), so the step that allocates them maps nothing.

Owns: its thread and queue, and `error` (the last failed prefetch, which costs only the latency it
was to hide). Mutates the pool only through `prefetch`, under the pool's own guard. The step planner
submits (under the store lock); `close` stops the thread (the store's `close`).
"""

from __future__ import annotations

import queue
import threading

from .pool import VirtualPool


class PageMapper:
    """vAttention's background mapper: a daemon thread that runs `pool.prefetch` for the blocks the
    next step will write, so the step's allocation finds them mapped. `submit` never blocks."""

    def __init__(self, pool: VirtualPool):
        self.pool = pool
        self._queue: queue.Queue[list[tuple[str, int]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="stateful-hf-page-mapper", daemon=True)
        self._thread.start()
        self.error: BaseException | None = None

    def submit(self, owners: list[tuple[str, int]]) -> None:
        if owners:
            self._queue.put(list(owners))

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
