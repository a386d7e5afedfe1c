"""Front-ends over `Engine.submit`: multi-turn chat that keeps the conversation, batch `generate`, asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from .request import RequestHandle, RequestOutput
from .sampling import SamplingParams


class Conversations:
    """The chat messages kept per session, and each session's last chat turn. Collaborators:
    `submit(session_id, prompt, sampling) -> RequestHandle` (the engine's), `when_finished(handle, fn)`
    (calls fn(output) once the request has ended, before its handle reads as done), the tokenizer.
    Mutates only its own messages (appending a finished turn's reply from the engine's stepping thread)."""

    def __init__(self, submit: Callable[..., RequestHandle],
                 when_finished: Callable[[RequestHandle, Callable[[RequestOutput], None]], None], tokenizer):
        self._submit, self._when_finished, self.tokenizer = submit, when_finished, tokenizer
        self._messages: dict[str, list[dict]] = {}
        self._last: dict[str, RequestHandle] = {}

    def messages(self, session_id: str) -> list[dict]:
        """The chat messages kept for a session (a copy)."""
        return [dict(m) for m in self._messages.get(session_id, [])]

    def last(self, session_id: str) -> RequestHandle | None:
        """The session's last chat turn, or None."""
        return self._last.get(session_id)

    def submit(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
               system: str | None = None) -> RequestHandle:
        """Queue the next chat turn: the user message is appended to the kept conversation, the chat
        template renders all of it, and the reply is appended when the turn finishes. Waits for the
        session's previous chat turn first (its reply is part of this prompt)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template: Engine(model, tokenizer=...)")
        previous = self._last.get(session_id)
        if previous is not None:
            previous.wait()
        messages = self._messages.setdefault(session_id, [])
        if system is not None and not messages:
            messages.append({"role": "system", "content": system})
        prompt = messages + [{"role": "user", "content": user_message}]
        handle = self._submit(session_id, prompt, sampling)

        def on_finish(out: RequestOutput) -> None:
            if out.finish_reason in ("stop", "length"):       # a failed / cancelled turn is not kept
                messages.extend([prompt[-1], {"role": "assistant", "content": out.text or ""}])

        self._when_finished(handle, on_finish)
        self._last[session_id] = handle
        return handle


def generate(engine, session_ids: Sequence[str], prompts: Sequence,
             sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
    """`engine.generate`: submit one turn per (session, prompt), wait for all (driving the steps in
    this thread when no background loop runs)."""
    if len(session_ids) != len(prompts):
        raise ValueError(f"{len(session_ids)} session ids for {len(prompts)} prompts")
    params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    handles = [engine.submit(s, p, sp) for s, p, sp in zip(session_ids, prompts, params, strict=True)]
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(handles), desc="generate", unit="req")
    done = 0
    while done < len(handles):
        engine.loop.wait_until(lambda seen=done: sum(h.done for h in handles) > seen)
        now = sum(h.done for h in handles)
        if bar is not None:
            bar.update(now - done)
        done = now
    if bar is not None:
        bar.close()
    return [h.output() for h in handles]


async def agenerate(engine, session_ids: Sequence[str], prompts: Sequence,
                    sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
    """`engine.generate` for asyncio (starts the engine's background loop)."""
    engine.start()
    params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    handles = [engine.submit(s, p, sp) for s, p, sp in zip(session_ids, prompts, params, strict=True)]

    def wait(h: RequestHandle) -> RequestOutput:
        h.wait()
        out = h.output()
        assert out is not None         # wait() without a timeout returns once the request ended
        return out

    return list(await asyncio.gather(*(asyncio.to_thread(wait, h) for h in handles)))


async def achat(engine, session_id: str, user_message: str, sampling: SamplingParams | None = None,
                system: str | None = None) -> AsyncIterator[str]:
    """`engine.chat` for asyncio: an async iterator of text deltas."""
    engine.start()
    handle = await asyncio.to_thread(engine.chat_submit, session_id, user_message, sampling, system)
    async for delta in handle.atext_deltas():
        yield delta
