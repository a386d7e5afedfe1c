"""OpenAI's `n`: the choices of one prompt run as forks of it (docs/server-api.md#n-choices-as-forks).

Choice 0 runs first; once its first event has come (its prompt's prefill has committed) choices
1..n-1 start, each in a session of its own with the same prompt ids, as forks of choice 0's session:
the turns of one prompt are a fork group (`fork=`, routed to one replica), and on the replica each
later turn's new session is `KVStore.fork` of the group's first (`cache/prefix/fork.py`: the prompt's
full chunks shared, its partial last chunk copied to a device block of its own), so its first step
computes one row, the prompt's last (whose logits its first token is sampled from: the store keeps
K/V, not logits). Where a fork cannot be (prefix sharing off, the parent gone) the choice adopts the
prompt's indexed full chunks at admission and computes the rest. All n decode in the engine's
batches. Choice i samples with `choice_seed(seed, i)`, its own generator (vLLM's rule), so it gives
the tokens of the same request with n = 1 and that seed. Usage counts each prompt once.

Without a session id every choice runs in a throwaway session of the caller's tenant. With one,
choice 0 runs in the session itself and choice i in a fork session (`fork_key`: a '#' no client id
has), and `SessionForks` holds them after the turn until the session's next turn, which continues
the choice whose history shares the longest prefix with its prompt (ties: the lowest index) and frees
the others. Continuing choice i > 0: the turn goes with `continues=` the fork's key; on the replica,
with the session's turn slot held, the session becomes a fork of it in one store operation
(`KVStore.fork(replace=True)`: its history, full chunks shared, partial last chunk copied; the
session's old chunks freed), so the turn computes only its new rows; the fork is freed once the
turn's first event has come. Where that cannot be (the session moved to another replica, the fork
busy) the session goes on as choice 0's and the turn recomputes from where its prompt leaves that
history. Everything goes through the router's public methods (`stream`, `delete_session`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from ..cache.sessions.history import common_prefix
from ..cache.sessions.tenant import session_key, split_key
from ..engine import SamplingParams
from .protocol import (
    APIError,
    StreamLogprobs,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage,
)
from .router_door import RouterDoor, RouterWrapper

FORK_MARK = "#"                   # in fork sessions' ids; never in a client's (app.SESSION_ID)
_INT64 = 2**63
FREE_TRIES, FREE_WAIT = 100, 0.1  # freeing a fork whose turn is still ending: tries, seconds between
MAX_HELD = 10_000                 # sessions whose choices are held, all tenants (past it the oldest's go)


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: the request's + i, wrapped into int64 (vLLM's rule); None stays None (unseeded)."""
    return None if seed is None else (seed + i + _INT64) % (2 * _INT64) - _INT64


def fork_key(session: str, tag: str, i: int) -> str:
    """The store key of choice i (i >= 1) of an n > 1 turn (`tag`: the turn's) of the session keyed `session`."""
    tenant, named = split_key(session)
    return session_key(tenant, f"{named}{FORK_MARK}{tag}.{i}")


@dataclass(frozen=True, slots=True)
class ChoiceGroup:
    """One prompt's n choices: its ids, choice 0's sampling (choice i's: `choice_seed`), the session key
    (None: throwaway sessions), the index of its first choice in the response (prompt-major), and the
    text a completion's `echo` puts first (None: none)."""

    ids: tuple[int, ...]
    sampling: SamplingParams
    n: int
    session: str | None
    first: int
    echo: str | None = None

    def sampling_of(self, i: int) -> SamplingParams:
        return replace(self.sampling, seed=choice_seed(self.sampling.seed, i)) if i else self.sampling


@dataclass(frozen=True, slots=True)
class HeldForks:
    """A session's choices after its n > 1 turn: each one's session key (choice 0: the session itself),
    the turn's prompt and each choice's tokens, in choice order (a choice's history: prompt + its tokens)."""

    keys: tuple[str, ...]
    prompt: tuple[int, ...]
    answers: tuple[tuple[int, ...], ...]

    def best(self, prompt: Sequence[int]) -> int:
        """The choice whose history shares the longest prefix with `prompt`; ties: the lowest index."""
        n = len(self.prompt)
        if common_prefix(self.prompt, prompt) < n:
            return 0
        rest = prompt[n:]
        return max(range(len(self.keys)), key=lambda i: (common_prefix(self.answers[i], rest), -i))


class SessionForks(RouterWrapper):
    """A `RouterDoor` over the router (`Router` or the `TenantGate` over it), holding the choices of each
    session's last n > 1 turn until its next turn (module docstring); the rest forwarded.
    `_held`: session key -> its `HeldForks`, oldest first (past `MAX_HELD` sessions the oldest's forks
    go); `_open`: session key -> the mark of its n > 1 turn in flight (any other turn of the session
    clears it: that turn's forks are then freed, not held)."""

    def __init__(self, router: RouterDoor):
        super().__init__(router)
        self._held: dict[str, HeldForks] = {}
        self._open: dict[str, object] = {}
        self._freeing: set[asyncio.Task] = set()

    async def stream(self, session_id: str | None, prompt: list[int], sampling, **scope) -> AsyncGenerator[dict, None]:
        """A turn (`Router.stream`): a session's held choices are settled first (`settle`)."""
        chosen = await self.settle(session_id, prompt) if session_id is not None else None
        async with contextlib.aclosing(self.settled(session_id, prompt, sampling, chosen, **scope)) as events:
            async for ev in events:
                yield ev

    async def settled(self, session_id: str | None, prompt: list[int], sampling, chosen: str | None = None,
                      **scope) -> AsyncGenerator[dict, None]:
        """`Router.stream` of a turn `settle` has prepared: the session first takes the fork `chosen`'s
        history and KV (`continues`, on its replica with its turn slot held), and `chosen` is freed once
        the turn's first event has come (gone by then where it was taken)."""
        after = () if chosen is None else (chosen,)
        try:
            async with contextlib.aclosing(self.router.stream(session_id, prompt, sampling, continues=chosen,
                                                              **scope)) as events:
                async for ev in events:
                    if after:
                        after, freed = (), after
                        await self.free(freed)
                    yield ev
        finally:
            if after:
                self.free_later(after)

    async def settle(self, session_id: str, prompt: Sequence[int]) -> str | None:
        """Before a turn of `session_id` with `prompt`: its held choices go (module docstring). Returns
        the fork the turn continues (None: the session as it is)."""
        self._open.pop(session_id, None)
        held = self._held.pop(session_id, None)
        if held is None:
            return None
        best = held.best(prompt)
        await self.free([k for i, k in enumerate(held.keys) if i not in (0, best)])
        return held.keys[best] if best else None

    def held(self, session_id: str) -> HeldForks | None:
        """The choices held for the session (None: none)."""
        return self._held.get(session_id)

    def open(self, session_id: str) -> object:
        """An n > 1 turn of `session_id` starts (after its choice 0's `settle`): its mark for `hold`."""
        mark = self._open[session_id] = object()
        return mark

    def hold(self, session_id: str, mark: object, forks: HeldForks) -> None:
        """The n > 1 turn `mark` of `session_id` ended well: hold its choices, unless another turn of
        the session has started since (then its forks are freed)."""
        if self._open.get(session_id) is mark:
            del self._open[session_id]
            self._held[session_id] = forks
            if len(self._held) > MAX_HELD:
                self.free_later(self._held.pop(next(iter(self._held))).keys[1:])
        else:
            self.free_later(forks.keys[1:])

    def close(self, session_id: str, mark: object, forks: Sequence[str]) -> None:
        """The n > 1 turn `mark` failed or was cancelled: its fork sessions go (when their turns have ended)."""
        if self._open.get(session_id) is mark:
            del self._open[session_id]
        self.free_later(forks)

    async def _delete(self, keys: Sequence[str]) -> list[str]:
        """Delete these sessions (one already gone is fine); returns those still busy (a turn in flight)."""
        busy = []
        for key in keys:
            try:
                await self.router.delete_session(key)
            except APIError as e:
                if e.status == 409:
                    busy.append(key)
        return busy

    async def free(self, keys: Sequence[str]) -> None:
        """Delete these sessions now; those still busy are left to `free_later`."""
        self.free_later(await self._delete(keys))

    def free_later(self, keys: Sequence[str]) -> None:
        """Delete these sessions once their turns have ended (a cancelled choice ends within a step),
        trying `FREE_TRIES` times `FREE_WAIT` s apart."""
        if not keys:
            return

        async def run() -> None:
            left = list(keys)
            for _ in range(FREE_TRIES):
                left = await self._delete(left)
                if not left:
                    return
                await asyncio.sleep(FREE_WAIT)
        task = asyncio.get_running_loop().create_task(run())
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)

    async def delete_session(self, sid: str) -> dict:
        """`Router.delete_session`, freeing the session's held choices too."""
        try:
            out = await self.router.delete_session(sid)
        except APIError as e:
            if e.status == 404 and sid in self._held:      # gone (collected by the session bounds): forks too
                await self.free(self._held.pop(sid).keys[1:])
            raise
        held = self._held.pop(sid, None)                  # busy (409): the forks stay held with it
        if held is not None:
            await self.free(held.keys[1:])
        return out


async def stream_choices(forks: SessionForks, groups: Sequence[ChoiceGroup], *, cache_salt: str | None,
                         tenant: str | None) -> AsyncGenerator[tuple[int, dict], None]:
    """Every choice's events tagged with its index, as they come, until each choice's "done" or the
    first "error" (the last item then; the other choices are cancelled). Per group, choice 0 first, the
    others once its first event has come (module docstring). With a session, the choices are held
    (`SessionForks.hold`) once every one ended well, else freed."""
    queue: asyncio.Queue[tuple[int, dict | None]] = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    marks: list[tuple[ChoiceGroup, object, list[str]]] = []   # (group, mark, fork keys) of groups with a session
    finals: dict[int, dict] = {}
    firsts: dict[int, str] = {}                               # choice index -> the type of its first event

    async def choice(index: int, sid: str | None, g: ChoiceGroup, i: int, chosen: str | None,
                     started: asyncio.Event | None, tag: str) -> None:
        try:
            events = forks.settled(sid, list(g.ids), g.sampling_of(i), chosen, cache_salt=cache_salt,
                                   tenant=tenant if sid is None else None, fork=tag if g.n > 1 else None)
            async with contextlib.aclosing(events):
                async for ev in events:
                    firsts.setdefault(index, ev["type"])
                    if started is not None:
                        started.set()
                    await queue.put((index, ev))
                    if ev["type"] == "error":
                        break
        finally:
            if started is not None:
                started.set()
            await queue.put((index, None))

    async def group(g: ChoiceGroup) -> None:
        chosen: str | None = None
        keys: list[str] = []
        tag = uuid.uuid4().hex[:8]               # the group's fork tag; with a session, in its forks' keys
        if g.session is not None:
            chosen = await forks.settle(g.session, g.ids)
            keys = [fork_key(g.session, tag, i) for i in range(1, g.n)]
            marks.append((g, forks.open(g.session), keys))
        started = asyncio.Event()
        tasks.append(asyncio.create_task(choice(g.first, g.session, g, 0, chosen, started, tag)))
        await started.wait()
        if firsts.get(g.first) in (None, "error"):
            return                               # choice 0 failed: its error is the answer
        for i in range(1, g.n):
            tasks.append(asyncio.create_task(choice(g.first + i, keys[i - 1] if keys else None, g, i, None, None,
                                                    tag)))

    starters = [asyncio.create_task(group(g)) for g in groups]
    total, ended = sum(g.n for g in groups), 0
    try:
        while ended < total:
            index, ev = await queue.get()
            if ev is None:
                ended += 1
                if index not in finals:          # ended without its answer or an error (cannot happen)
                    yield index, {"type": "error", "error": APIError(500, "a choice ended without its answer",
                                                                     type="server_error").to_dict()}
                    return
                continue
            if ev["type"] == "done":
                finals[index] = ev
            yield index, ev
            if ev["type"] == "error":
                return
    finally:                  # before any await: a client gone cancels this generator's closing too
        for g, mark, keys in marks:
            assert g.session is not None
            if len(finals) == total:
                forks.hold(g.session, mark, HeldForks((g.session, *keys), g.ids, tuple(
                    tuple(finals[g.first + i]["token_ids"]) for i in range(g.n))))
            else:
                forks.close(g.session, mark, keys)
        for t in starters + tasks:
            t.cancel()
        await asyncio.gather(*starters, *tasks, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class ChoiceShape:
    """How the choices are answered: `kind` "chat" or "completion", the model's name, the tokenizer,
    `token_ids` (return_token_ids), `include_usage` (a streamed last chunk with the usage), one chat
    reply reader per choice (tool_parse.ChatReply; None: plain text) and `on_done` (awaited once
    every choice has ended well: the session's X-Session-Retain)."""

    kind: str
    model: str
    tokenizer: object
    token_ids: bool = False
    include_usage: bool = False
    readers: Sequence | None = None
    on_done: Callable | None = None


def total_usage(groups: Sequence[ChoiceGroup], finals: dict[int, dict], shape: ChoiceShape) -> dict:
    """OpenAI's usage of n choices: each prompt counted once (its choice 0's prompt and reused tokens),
    completion tokens summed over the choices (reasoning tokens too, where counted)."""
    counted = {i: f if shape.readers is None else shape.readers[i].counted(shape.tokenizer, f)
               for i, f in finals.items()}
    out = {"prompt_tokens": sum(finals[g.first]["prompt_tokens"] for g in groups),
           "reused_tokens": sum(finals[g.first]["reused_tokens"] for g in groups),
           "completion_tokens": sum(f["completion_tokens"] for f in counted.values())}
    if any("reasoning_tokens" in f for f in counted.values()):
        out["reasoning_tokens"] = sum(f.get("reasoning_tokens", 0) for f in counted.values())
    return usage(out)


async def answer(forks: SessionForks, groups: Sequence[ChoiceGroup], shape: ChoiceShape, stream: bool, *,
                 rid: str, cache_salt: str | None, tenant: str | None) -> tuple[dict, AsyncIterator[str] | None]:
    """The n choices of `groups`: (response body, None), or with `stream` ({}, server-sent events); the
    body names the replica that ran choice 0 under "replica" (the X-Replica header: pop it).
    An error before choice 0's first token raises APIError (the HTTP status); one after it fails the
    response (stream False) or ends the stream with the error's body, as a single choice's does."""
    events = stream_choices(forks, groups, cache_salt=cache_salt, tenant=tenant)
    first = await anext(events, None)
    if first is None or first[1]["type"] == "error":
        await events.aclose()
        raise APIError(500, "no output", type="server_error") if first is None else \
            _named(APIError.from_dict(first[1]["error"]), shape.kind)
    created, finals = int(time.time()), {}
    if not stream:
        async with contextlib.aclosing(events):
            item: tuple[int, dict] | None = first
            while item is not None:
                index, ev = item
                if ev["type"] == "error":
                    raise _named(APIError.from_dict(ev["error"]), shape.kind)
                if ev["type"] == "done":
                    finals[index] = ev
                item = await anext(events, None)
        if shape.on_done is not None:
            await shape.on_done()
        return {"id": rid, "object": "chat.completion" if shape.kind == "chat" else "text_completion",
                "created": created, "model": shape.model, "replica": str(finals[0].get("replica", "")),
                "choices": [_choice(groups, finals, shape, i) for i in range(len(finals))],
                "usage": total_usage(groups, finals, shape)}, None
    return {}, _sse(events, first, groups, shape, rid, created)


def _choice(groups: Sequence[ChoiceGroup], finals: dict[int, dict], shape: ChoiceShape, i: int) -> dict:
    """Choice i of a non-streamed answer."""
    final, tok = finals[i], shape.tokenizer
    if shape.kind == "chat":
        choice = chat_response("", shape.model, final, shape.token_ids, tok)["choices"][0]
        if shape.readers is not None:
            choice["message"], choice["finish_reason"] = shape.readers[i].message(final["text"],
                                                                                   final["finish_reason"])
    else:
        echo = next(g.echo for g in groups if g.first <= i < g.first + g.n)
        choice = completion_response("", shape.model, final, shape.token_ids, tok, echo)["choices"][0]
    return {**choice, "index": i}


async def _sse(events: AsyncGenerator[tuple[int, dict], None], first: tuple[int, dict], groups: Sequence[ChoiceGroup],
               shape: ChoiceShape, rid: str, created: int) -> AsyncIterator[str]:
    """The answer's server-sent events: every chunk carries its choice's `index` and, when asked, the
    logprobs of the tokens its text completes (one `StreamLogprobs` per choice, as a single choice's)."""
    chat, model, finals = shape.kind == "chat", shape.model, {}
    lps = {i: StreamLogprobs(chat, shape.tokenizer, g.sampling.logprobs is not None)
           for g in groups for i in range(g.first, g.first + g.n)}

    def piece(i: int, text: str = "", reason: str | None = None, delta: dict | None = None,
              logprobs: bool = True) -> str:
        lp = lps[i].take() if logprobs else None
        if chat:
            body = chat_chunk(rid, model, created, delta if delta is not None else
                              ({"content": text} if text or reason is None else {}), reason, logprobs=lp)
        else:
            body = completion_chunk(rid, model, created, text, reason, index=i, logprobs=lp)
        body["choices"][0]["index"] = i
        return _data(body)

    async with contextlib.aclosing(events):
        for g in groups:
            for i in range(g.first, g.first + g.n):
                if chat:
                    yield piece(i, delta={"role": "assistant", "content": ""}, logprobs=False)
                elif g.echo:
                    yield piece(i, g.echo, logprobs=False)
        item: tuple[int, dict] | None = first
        while item is not None:
            i, ev = item
            reader = shape.readers[i] if shape.readers is not None else None
            if ev["type"] == "delta":
                lps[i].add(ev)
            if ev["type"] == "delta" and ev["text"]:
                if reader is not None:
                    for delta in reader.deltas(ev["text"]):
                        yield piece(i, delta=delta)
                else:
                    yield piece(i, ev["text"])
            elif ev["type"] == "error":
                yield _data(_named(APIError.from_dict(ev["error"]), shape.kind).body())
                break
            elif ev["type"] == "done":
                finals[i] = ev
                reason = ev["finish_reason"]
                if reader is not None:
                    deltas, reason = reader.close(reason)
                    for delta in deltas:
                        yield piece(i, delta=delta)
                yield piece(i, "", reason)
            item = await anext(events, None)
        else:
            if shape.include_usage:
                use = total_usage(groups, finals, shape)
                yield _data(chat_chunk(rid, model, created, {}, None, use, False) if chat else
                            completion_chunk(rid, model, created, "", None, use, False))
            if shape.on_done is not None:
                await shape.on_done()
        yield "data: [DONE]\n\n"


def _named(e: APIError, kind: str) -> APIError:
    """An engine error about the prompt names the chat's own field, `messages`."""
    if kind == "chat" and e.param == "prompt":
        e.param = "messages"
    return e


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
