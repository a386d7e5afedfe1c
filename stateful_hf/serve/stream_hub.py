"""`StreamHub`: request progress from the engine's stepping thread to asyncio coroutines.

Owns: the open streams (one per turn being streamed: its handle, its event loop, an asyncio event
and the last snapshot seen) and one daemon thread for all of them. It may mutate only its streams;
it reads each handle's published state (`RequestHandle.progress`) under the engine's condition,
which the engine notifies after every step. A stream is delivered on its own loop
(`call_soon_threadsafe`): the coroutine waits on `event`, then reads `latest`.
"""

from __future__ import annotations

import asyncio
import threading

from ..engine import Engine


class _Stream:
    """One streamed turn: `event` is set on `loop` when `latest` (a `Progress`: tokens, stable text,
    logprobs, text ends, output) changed."""

    __slots__ = ("handle", "loop", "event", "seen", "latest")

    def __init__(self, handle, loop):
        self.handle, self.loop, self.event = handle, loop, asyncio.Event()
        self.seen, self.latest = (-1, -1, False), None


class StreamHub:
    """Forwards request progress from the engine's stepping thread to asyncio: one thread for all
    streams, woken by the engine's condition (notified after every step)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: set[_Stream] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stateful-hf-serve-hub", daemon=True)
        self._thread.start()

    def open(self, handle) -> _Stream:
        st = _Stream(handle, asyncio.get_running_loop())
        with self._lock:
            self._streams.add(st)
        self._wake.set()
        return st

    def close(self, st: _Stream) -> None:
        with self._lock:
            self._streams.discard(st)

    def shutdown(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        cv = self.engine.condition
        while not self._closed:
            with self._lock:
                streams = list(self._streams)
            if not streams:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            with cv:
                ready = self._collect(streams)
                if not ready:
                    cv.wait(timeout=0.05)
                    ready = self._collect(streams)
            for st, snap in ready:
                st.loop.call_soon_threadsafe(self._deliver, st, snap)

    @staticmethod
    def _collect(streams):
        out = []
        for st in streams:      # the handle's published state (RequestHandle.publish), read under engine.condition
            snap = st.handle.progress()
            key = (len(snap.tokens), len(snap.text), snap.output is not None)
            if key != st.seen:
                st.seen = key
                out.append((st, snap))
        return out

    @staticmethod
    def _deliver(st: _Stream, snap) -> None:
        st.latest = snap
        st.event.set()
