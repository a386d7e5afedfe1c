"""`RequestHandle`: what `Engine.submit` returns. Stream tokens or text, wait, cancel; sync or async."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

from .loop import StepLoop
from .request import RequestOutput


class RequestFailed(RuntimeError):
    """`result()` of a request that failed; the cause is chained (`__cause__`) and in `output.error`."""

    def __init__(self, output: RequestOutput):
        super().__init__(f"request {output.request_id} of session {output.session_id!r} failed: {output.error}")
        self.output = output


class RequestHandle:
    """Published to by the engine's stepping thread; read from any thread.

    If the engine has no background loop running, waiting on a handle drives the engine's steps
    in the calling thread (so `submit(...).result()` works without `start()`). Collaborators: the
    engine's `loop` (its condition guards this handle's published state) and `cancel(request_id)`.
    """

    def __init__(self, request_id: int, session_id: str, loop: StepLoop, cancel: Callable[[int], None]):
        self.request_id = request_id
        self.session_id = session_id
        self._loop, self._cancel = loop, cancel
        self._cv = loop.cv                    # the engine's condition: notified after every step
        self._tokens: list[int] = []
        self._text = ""
        self._stable = 0                      # chars of _text that may be streamed
        self._output: RequestOutput | None = None

    def __repr__(self) -> str:
        state = self._output.finish_reason if self._output else "running"
        return f"RequestHandle(id={self.request_id}, session={self.session_id!r}, {state})"

    # ---- engine side ----------------------------------------------------------------------------

    def publish(self, tokens: list[int], text: str, stable: int, output: RequestOutput | None = None) -> None:
        """The engine's stepping thread: the tokens and text so far (`stable` chars may be streamed);
        `output` once the request has ended. The only writer of this handle's state."""
        with self._cv:
            self._tokens, self._text, self._stable = list(tokens), text, stable
            if output is not None:
                self._output = output
            self._cv.notify_all()

    # ---- reader side ----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._output is not None

    def snapshot(self) -> tuple[list[int], str, RequestOutput | None]:
        """(tokens so far, the stable text so far, the final output or None), read consistently."""
        with self._cv:
            return list(self._tokens), self._text[:self._stable], self._output

    def cancel(self) -> None:
        """Ask the engine to stop this request after the current step (no-op if already done)."""
        self._cancel(self.request_id)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request ends (never raises for its failure). Returns whether it has ended."""
        return self._wait(lambda: self._output is not None, timeout)

    def _wait(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        return self._loop.wait_until(pred, timeout)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request ends. Raises RequestFailed if it failed; a cancelled request returns
        its partial output with finish_reason "cancelled"."""
        self._wait(lambda: self._output is not None, timeout)
        if self._output is None:
            raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
        if self._output.error is not None:
            raise RequestFailed(self._output) from self._output.error
        return self._output

    def output(self) -> RequestOutput | None:
        """The final output (also for a failed request), or None while it runs."""
        return self._output

    def _next(self, kind: str, seen: int) -> tuple[list[int] | str, bool]:
        """Block until there is more than `seen` (tokens or stable chars) or the request is done."""
        def ready() -> bool:
            n = len(self._tokens) if kind == "tokens" else self._stable
            return n > seen or self._output is not None

        self._wait(ready)
        with self._cv:
            new = self._tokens[seen:] if kind == "tokens" else self._text[seen:self._stable]
            return new, self._output is not None and (len(new) == 0 or kind == "text")

    def __iter__(self) -> Iterator[int]:
        """Generated token ids as they are sampled. Ends when the request ends (see `result()`)."""
        seen = 0
        while True:
            new, done = self._next("tokens", seen)
            yield from new
            seen += len(new)
            if done or (not new and self._output is not None):
                return

    def text_deltas(self) -> Iterator[str]:
        """Pieces of the decoded text as they become stable (needs the engine's tokenizer)."""
        seen = 0
        while True:
            new, done = self._next("text", seen)
            if new:
                yield new
                seen += len(new)
            if done:
                return

    # ---- asyncio --------------------------------------------------------------------------------

    async def aresult(self) -> RequestOutput:
        self._loop.start()
        return await asyncio.to_thread(self.result)

    async def __aiter__(self) -> AsyncIterator[int]:
        self._loop.start()
        seen = 0
        while True:
            new, done = await asyncio.to_thread(self._next, "tokens", seen)
            for t in new:
                yield t
            seen += len(new)
            if done or (not new and self._output is not None):
                return

    async def atext_deltas(self) -> AsyncIterator[str]:
        self._loop.start()
        seen = 0
        while True:
            new, done = await asyncio.to_thread(self._next, "text", seen)
            if new:
                yield new
                seen += len(new)
            if done:
                return
