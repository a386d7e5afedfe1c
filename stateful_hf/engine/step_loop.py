"""`StepLoop`: who runs an engine's steps, and when. A background thread (`start()`), or, without
one, whichever thread waits on a result (`wait_until` drives the steps itself).

Owns the condition `cv` (the engine's inbox and request registry are guarded by it; it is notified
after every step) and the loop thread. Collaborators, passed in: `step()` runs one engine iteration
(and takes the engine's step lock itself), `has_work()` says whether a step would do anything,
`on_error(e)` is called (with the step lock free) when a background step raised,
`before_start()` runs in the thread that calls `start()` before the loop thread exists,
`on_thread()` runs first on the loop thread (it claims the thread's team sizing, `thread_sizing.py`),
and `after_step()` after each step (the engine's arrival window: it may wait on `cv` for submissions);
`on_wake()` runs on the loop thread when work came while it was idle, before that step (the
engine's burst window: it may wait on `cv` for more submissions); `wake_in()` says in how many seconds
the idle loop looks again without a notify (a warm-up coming due, `warmup.py`; None: only when notified).
Steps driven inline by a waiting thread run none of these hooks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StepLoop:
    def __init__(self, step: Callable[[], object], has_work: Callable[[], bool],
                 on_error: Callable[[Exception], None], before_start: Callable[[], object] | None = None,
                 on_thread: Callable[[], object] | None = None, after_step: Callable[[], object] | None = None,
                 on_wake: Callable[[], object] | None = None, wake_in: Callable[[], float | None] = lambda: None,
                 name: str = "stateful-hf-engine"):
        self.cv = threading.Condition()
        self._step, self._has_work, self._on_error, self._before_start = step, has_work, on_error, before_start
        self._on_thread, self._after_step, self._on_wake, self._wake_in = on_thread, after_step, on_wake, wake_in
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def notify(self) -> None:
        """Wake every waiter (call with `cv` held)."""
        self.cv.notify_all()

    def wait_until(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait for `pred` (read under no lock; re-checked after every step); drive the steps in this
        thread when no background loop runs. Returns `pred()` at the end (False on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pred():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self.running or not self._has_work():
                with self.cv:
                    self.cv.wait_for(pred, timeout=0.05 if left is None else min(left, 0.05))
            else:
                self._step()
        return True

    def start(self) -> None:
        """Start the background thread (idempotent)."""
        with self.cv:
            if self.running:
                return
            if self._before_start is not None:
                self._before_start()
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Run the work in flight to its end (inline if no thread runs), then end the thread."""
        self.wait_until(lambda: not self._has_work(), timeout)
        with self.cv:
            self._stopping = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self._on_thread is not None:
            self._on_thread()
        woke = True                         # a loop that starts was idle
        while True:
            with self.cv:
                if self._stopping:
                    return
                if not self._has_work():       # wait for a notify or a warm-up's time, then look again
                    woke = True
                    wake = self._wake_in()
                    self.cv.wait(timeout=None if wake is None else min(wake, threading.TIMEOUT_MAX))
                    continue
            try:
                if woke and self._on_wake is not None:
                    self._on_wake()
                woke = False
                self._step()
                if self._after_step is not None:
                    self._after_step()
            except Exception as e:          # a bug, not a request's fault: the engine fails what is in flight
                self._on_error(e)
