"""Front-ends over `Engine.submit`: multi-turn chat that keeps the conversation, and asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence

from .handle import RequestHandle
from .request import RequestOutput
from .sampling import SamplingParams


class ChatMixin:
    """Needs `submit`, `tokenizer`, `_chats` (session -> messages), `_last_chat`, `_on_finish`, `_cv`."""

    def conversation(self, session_id: str) -> list[dict]:
        """The chat messages kept for a session (a copy)."""
        return [dict(m) for m in self._chats.get(session_id, [])]

    def chat_submit(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
                    system: str | None = None) -> RequestHandle:
        """Queue the next chat turn: the user message is appended to the kept conversation, the chat
        template renders all of it, and the reply is appended when the turn finishes. Waits for the
        session's previous chat turn first (its reply is part of this prompt)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template: Engine(model, tokenizer=...)")
        previous = self._last_chat.get(session_id)
        if previous is not None:
            previous._wait(lambda: previous.done)
        messages = self._chats.setdefault(session_id, [])
        if system is not None and not messages:
            messages.append({"role": "system", "content": system})
        prompt = messages + [{"role": "user", "content": user_message}]
        handle = self.submit(session_id, prompt, sampling)

        def on_finish(out: RequestOutput) -> None:
            if out.finish_reason in ("stop", "length"):       # a failed / cancelled turn is not kept
                messages.extend([prompt[-1], {"role": "assistant", "content": out.text or ""}])

        with self._cv:
            if handle.done:
                on_finish(handle.output())
            else:
                self._on_finish[handle.request_id] = on_finish
        self._last_chat[session_id] = handle
        return handle

    def chat(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
             system: str | None = None) -> Iterator[str]:
        """Submit the next turn now and return an iterator of its text deltas."""
        return self.chat_submit(session_id, user_message, sampling, system).text_deltas()

    # ---- asyncio --------------------------------------------------------------------------------

    async def agenerate(self, session_ids: Sequence[str], prompts: Sequence,
                        sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """`generate` for asyncio (starts the background loop)."""
        self.start()
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        handles = [self.submit(s, p, sp) for s, p, sp in zip(session_ids, prompts, params, strict=True)]

        def wait(h: RequestHandle) -> RequestOutput:
            h._wait(lambda: h.done)
            return h.output()

        return list(await asyncio.gather(*(asyncio.to_thread(wait, h) for h in handles)))

    async def achat(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
                    system: str | None = None) -> AsyncIterator[str]:
        """`chat` for asyncio: an async iterator of text deltas."""
        self.start()
        handle = await asyncio.to_thread(self.chat_submit, session_id, user_message, sampling, system)
        async for delta in handle.atext_deltas():
            yield delta
