"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (docs/agents.md).

A response runs as one turn of a session, like a chat completion. Its session: the client's
(`X-Session-Id` or the body's `session_id`) when named; else, continuing a stored response
(`previous_response_id`), that response's session for its first continuation whose prompt extends the
response's, and a new session for any other (a fork: it starts from the prefix the store shares, so a
continuation with other `instructions` never cuts the chain's history; `response_store.py`); else a new
session named by the server (`resp_...`), or a throwaway one when the response is not stored
(`store: false`). The prompt is the whole conversation rendered through the chat template (tools:
`tools.py`), so the session reuses what it holds and only the new input is prefilled.

A background response (`background: true`) is stored as `queued` when it is created, runs as a task of
the event loop (`in_progress` from its first output), and ends `completed` / `incomplete` (continuable as
any stored response), `failed` or `cancelled` (`POST /v1/responses/{id}/cancel`; neither is
continuable). `include: ["message.output_text.logprobs"]` with `top_logprobs` returns the reply's
log-probabilities in its output_text part (plain-text replies); streamed, each `output_text.delta`
carries those of the tokens whose text it completes (the rest, an EOS's, in a last empty delta), and
`output_text.done` all of them.

Items and events: `response_items.py`; stored responses: `response_store.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..cache.sessions.tenant import session_key
from ..engine import SamplingParams
from ..engine.sampling import MAX_LOGPROBS
from .auth import request_tenant
from .protocol import APIError, StreamLogprobs, chat_logprobs, max_tokens_for, sampling_params
from .reasoning import reasons, with_reasoning_tokens
from .response_items import OutputBuilder, input_messages, item_id, reply_message, response_usage
from .response_store import PromptKey, ResponseStore, StoredResponse
from .retain import retain_of
from .structured import constrain
from .tool_parse import ReplyParser, prompt_for, reply_template_of
from .tools import ToolPlan, check_tool_choice, check_tools

log = logging.getLogger(__name__)

LOGPROBS = "message.output_text.logprobs"       # the one `include` value implemented
# OpenAI's other `include` values: refused by name (an unknown value is a 400 too)
INCLUDES = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
            "code_interpreter_call.outputs")
RUNNING = ("queued", "in_progress")             # a background response's statuses before it ends


class ResponsesRequest(BaseModel):
    """A Responses API request. Its fields are checked against fields.py's list first (refused ones are
    400s naming them; unknown ones dropped with a warning, or 400s with --strict-fields)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: Any
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    truncation: Literal["auto", "disabled"] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)           # extension (vLLM spelling)
    seed: int | None = None                                 # extension
    stream: bool = False
    background: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    metadata: dict | None = None
    text: dict | None = None
    session_id: str | None = None                           # extension, as chat's
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def refuse_unsupported(self) -> None:
        """A text format other than text is a 400 naming `text.format`; an `include` value other than
        the logprobs one a 400 naming it; `background` with `stream` or `store: false` a 400 naming
        `background` (the other refused fields: fields.py)."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") != "text":
            raise APIError(400, "`text.format` is not supported by this server; remove it from the request",
                           param="text.format", code="unsupported_parameter")
        for i, value in enumerate(self.include or ()):
            if value in INCLUDES:
                raise APIError(400, f"`include` value {value!r} is not supported by this server (only {LOGPROBS!r})",
                               param=f"include.{i}", code="unsupported_parameter")
            if value != LOGPROBS:
                raise APIError(400, f"include.{i}: unknown value {value[:80]!r} (supported: {LOGPROBS!r})",
                               param=f"include.{i}", code="invalid_value")
        if self.background and self.stream:
            raise APIError(400, "a background response is polled with GET /v1/responses/{id}, not streamed; set "
                           "stream to false", param="background", code="unsupported_parameter")
        if self.background and not self.store:
            raise APIError(400, "a background response is stored to be polled; set store to true (the default)",
                           param="background", code="unsupported_parameter")

    @property
    def logprobs(self) -> int | None:
        """The alternatives per token the reply's log-probabilities carry (None: none asked for)."""
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None

    def sampling(self, max_tokens: int, generation_config, stop: tuple[str, ...]) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                 "logprobs": self.logprobs}
        return sampling_params(generation_config, max_new_tokens=max_tokens, stop=stop,   # the floor: protocol.py
                               **{k: v for k, v in given.items() if v is not None})


@dataclass
class Turn:
    body: ResponsesRequest
    tenant: str
    sid: str | None                   # the store key of the session (None: a throwaway one)
    owns_session: bool
    conversation: list[dict]          # the chain's messages and the new input (no instructions)
    prompt: str
    ids: list[int]
    sampling: SamplingParams
    plan: ToolPlan | None
    previous: StoredResponse | None


@dataclass(frozen=True, slots=True)
class Run:
    """A background response running: its task, its turn and its stored object (whose status moves)."""

    task: asyncio.Task
    turn: Turn
    obj: dict


def install(app, router, config, kit) -> ResponseStore:
    """Add the Responses API's routes to `app`. `kit`: the app's helpers (`parse`, `encode`,
    `check_model`, `check_session_id`, `header_session`, `seeded`, `limits`): a
    namespace, since this module cannot import app.py (which imports it)."""
    store = app.state.responses = ResponseStore(config.responses)
    tok = config.tokenizer

    def prepare(raw: bytes, tenant: str, named: str | None) -> Turn:
        body = kit.parse(raw, ResponsesRequest, config.strict_fields)
        kit.check_model(body.model)
        kit.check_session_id(body.session_id)
        body.refuse_unsupported()
        prev = None
        if body.previous_response_id is not None:
            prev = store.get(tenant, body.previous_response_id)
            if prev is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            if prev.messages is None:                   # a background response running, cancelled or failed
                status = prev.body["status"]
                raise APIError(400, f"Previous response with id '{body.previous_response_id}' is {status}; only a "
                               "response that has ended with a reply can be continued" +
                               (" (poll it until it ends)" if status in RUNNING else ""),
                               param="previous_response_id", code="previous_response_not_continuable")
        earlier = prev.messages if prev else []
        tools = check_tools(body.tools, flat=True)
        choice = check_tool_choice(body.tool_choice, tools, flat=True)
        conversation = earlier + input_messages(body.input, earlier)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        want = body.max_output_tokens or 1
        while True:
            text, plan = prompt_for(tok, system + conversation, tools, choice, body.parallel_tool_calls is not False)
            n, ids = kit.encode(tok, text, config.max_model_len)
            if n + want <= config.max_model_len or body.truncation != "auto" or len(conversation) < 2:
                break
            conversation = _drop_oldest(conversation)        # truncation "auto": the oldest items go
        max_tokens = max_tokens_for(body.max_output_tokens, n, config.max_model_len, config.default_max_tokens,
                                        "input", "max_output_tokens")
        kit.limits.check_prompt(n, config.max_model_len, "input")
        if body.logprobs is not None and reply_template_of(tok, plan) is not None:
            raise APIError(400, "log-probabilities are returned for plain-text replies only (not with tools or a "
                           "template that reasons); remove the logprobs include", param="include",
                           code="unsupported_parameter")
        sampling = constrain(kit.seeded(body, body.sampling(max_tokens, config.generation_config,   # forced calls
                                                            () if plan is None else plan.stop)),
                             None, tok, config.grammar_compile_timeout, plan)
        if body.session_id and named is None:
            named = session_key(tenant, body.session_id)
        sid, owns = named, False
        if sid is None and prev is not None and body.store and store.claim(prev, ids):
            sid, owns = prev.session, prev.owns_session
        elif sid is None and body.store:
            sid, owns = session_key(tenant, item_id("resp")), True
        return Turn(body, tenant, sid, owns, conversation, text, ids, sampling, plan, prev)

    runs: dict[tuple[str, str], Run] = {}     # (tenant, id) -> a background response running

    async def drop_sessions(sessions: list[str], patience: float = 0.0) -> None:
        """Delete `sessions`; one with a turn still ending (a cancelled one) is retried for `patience` s."""
        for sid in sessions:
            deadline = time.monotonic() + patience
            while True:
                try:
                    await router.delete_session(sid)
                except APIError as e:
                    if e.status == 409 and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                        continue
                break

    def counted(final: dict, parser: ReplyParser | None) -> dict:
        """`final` with its `reasoning_tokens` where the template reasons (usage's output_tokens_details)."""
        reasoned = bool(parser.reasoning) if parser is not None and reasons(tok) else None
        return with_reasoning_tokens(tok, final, reasoned)

    def finish(turn: Turn, rid: str, created: int, builder: OutputBuilder, final: dict) -> dict:
        if final.get("logprobs") is not None:                # plain text: the one message's part (prepare)
            entries = chat_logprobs(final, tok)["content"]
            for item in builder.items:
                if item["type"] == "message":
                    item["content"][0]["logprobs"] = entries
        obj = response_object(turn, rid, created, config.model_name, builder.items, final)
        if turn.body.store:
            stored = StoredResponse(rid, turn.tenant, turn.sid, turn.owns_session,
                                    turn.conversation + [reply_message(builder.items)], obj,
                                    prompt=PromptKey.of(turn.ids))
            dropped = store.put(stored)
            if dropped:
                asyncio.get_running_loop().create_task(drop_sessions(dropped))
        return obj

    def start(turn: Turn, rid: str, created: int, retain) -> dict:
        """Store the background response `rid` as queued and start its task; returns its object."""
        obj = response_object(turn, rid, created, config.model_name, [], None, status="queued")
        dropped = store.put(StoredResponse(rid, turn.tenant, turn.sid, turn.owns_session, None, obj))
        if dropped:
            asyncio.get_running_loop().create_task(drop_sessions(dropped))
        key = (turn.tenant, rid)
        task = asyncio.get_running_loop().create_task(background(turn, rid, created, retain, obj))
        runs[key] = Run(task, turn, obj)
        task.add_done_callback(lambda _: runs.pop(key, None))
        return dict(obj)

    async def background(turn: Turn, rid: str, created: int, retain, obj: dict) -> None:
        """Run a background response to its end: completed / incomplete (stored as any response),
        failed (an error), or cancelled (this task cancelled: `cancel`). `obj`: its stored object,
        whose status turns in_progress at the first output."""
        ended = False
        try:
            events = router.stream(turn.sid, turn.ids, turn.sampling, cache_salt=turn.body.cache_salt,
                                   tenant=turn.tenant if turn.sid is None else None)
            final = None
            async with contextlib.aclosing(events):
                async for ev in events:
                    obj["status"] = "in_progress"
                    final = ev
            if final is None or final["type"] == "error":
                err = APIError(500, "no output", type="server_error") if final is None else \
                    _as_input(APIError.from_dict(final["error"]))
                ended = True
                end(turn, obj, "failed", {"code": err.code or err.type, "message": err.message})
                return
            template = reply_template_of(tok, turn.plan)
            parser = ReplyParser(turn.plan, turn.prompt, template) if template is not None else None
            builder = OutputBuilder()
            builder.add(((parser.feed(final["text"]) if parser else [("text", final["text"])]) if final["text"]
                         else []) + (parser.close() if parser else []))
            builder.close()
            finish(turn, rid, created, builder, counted(final, parser))
            ended = True
            if retain is not None and turn.sid is not None:
                await asyncio.shield(router.retain(turn.sid, retain))
        except asyncio.CancelledError:
            if not ended:
                end(turn, obj, "cancelled", None)
            raise
        except Exception:                               # a bug: the response fails, the server goes on
            log.exception("background response %s failed", rid)
            if not ended:
                end(turn, obj, "failed", {"code": "server_error", "message": "The server had an error while "
                                          f"processing the response {rid}."})

    def end(turn: Turn, obj: dict, status: str, error: dict | None) -> None:
        """A background response ends without a reply to continue (failed, cancelled): stored so, its
        session deleted when the server named it and no stored response holds it."""
        obj["status"] = status
        ended = {**obj, "error": error, "output": [], "usage": None}
        dropped = store.put(StoredResponse(obj["id"], turn.tenant, turn.sid, turn.owns_session, None, ended))
        if dropped:                                     # a cancelled turn may still be ending: retried
            asyncio.get_running_loop().create_task(drop_sessions(dropped, patience=30.0))

    async def cancel(tenant: str, rid: str) -> StoredResponse | None:
        """Cancel the tenant's background response `rid` if it is running, and wait for its task to end
        (its turn cancelled in the engine, the response stored as cancelled); returns the stored one."""
        run = runs.get((tenant, rid))
        if run is not None:
            run.task.cancel()
            await asyncio.wait({run.task})
            if run.obj["status"] in RUNNING:             # cancelled before it started: no handler ran
                end(run.turn, run.obj, "cancelled", None)
        return store.get(tenant, rid)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        named, retain = kit.header_session(request), retain_of(request)
        tenant = request_tenant(request)
        turn = await run_in_threadpool(prepare, await request.body(), tenant, named)
        rid, created = item_id("resp"), int(time.time())
        if turn.body.background:
            return JSONResponse(start(turn, rid, created, retain))
        events = router.stream(turn.sid, turn.ids, turn.sampling, cache_salt=turn.body.cache_salt,
                               tenant=tenant if turn.sid is None else None)
        first = await anext(events, None)
        if first is None or first["type"] == "error":
            await events.aclose()
            if first is None:
                raise APIError(500, "no output", type="server_error")
            raise _as_input(APIError.from_dict(first["error"]))
        template = reply_template_of(tok, turn.plan)     # calls, reasoning, tool-result tags stripped
        parser = ReplyParser(turn.plan, turn.prompt, template) if template is not None else None
        builder = OutputBuilder()

        def pieces(text: str) -> list:
            return (parser.feed(text) if parser else [("text", text)]) if text else []

        if not turn.body.stream:
            final = first
            async with contextlib.aclosing(events):
                async for ev in events:
                    final = ev
            if final["type"] == "error":
                raise _as_input(APIError.from_dict(final["error"]))
            builder.add(pieces(final["text"]) + (parser.close() if parser else []))
            builder.close()
            if retain is not None and turn.sid is not None:      # X-Session-Retain: after the turn (retain.py)
                await router.retain(turn.sid, retain)
            return JSONResponse(finish(turn, rid, created, builder, counted(final, parser)))

        async def sse() -> AsyncIterator[str]:
            seq = 0

            def emit(event: dict) -> str:
                nonlocal seq
                seq += 1
                return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': seq - 1})}\n\n"

            started = response_object(turn, rid, created, config.model_name, [], None)
            yield emit({"type": "response.created", "response": started})
            yield emit({"type": "response.in_progress", "response": started})
            lp = StreamLogprobs(True, tok, turn.sampling.logprobs is not None)    # plain text only (prepare)

            def entries() -> list | None:
                got = lp.take()
                return None if got is None else got["content"]
            async with contextlib.aclosing(events):
                ev = first
                while ev is not None:
                    if ev["type"] == "delta":
                        lp.add(ev)
                        for e in builder.add(pieces(ev["text"]), entries() if ev["text"] else None):
                            yield emit(e)
                    elif ev["type"] == "error":
                        err = _as_input(APIError.from_dict(ev["error"]))
                        yield emit({"type": "error", "code": err.code, "message": err.message, "param": err.param})
                        return
                    elif ev["type"] == "done":
                        if lp.pending and builder.message is not None:   # the tokens without text (an EOS)
                            for e in builder.add([("text", "")], entries()):
                                yield emit(e)
                        for e in builder.add(parser.close() if parser else []) + builder.close():
                            yield emit(e)
                        obj = finish(turn, rid, created, builder, counted(ev, parser))
                        if retain is not None and turn.sid is not None:
                            await router.retain(turn.sid, retain)
                        yield emit({"type": f"response.{obj['status']}", "response": obj})
                    ev = await anext(events, None)

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def stored(request: Request, rid: str) -> StoredResponse:
        r = store.get(request_tenant(request), rid)
        if r is None:
            raise _not_found(rid)
        return r

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str):
        return JSONResponse(stored(request, response_id).body)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        """OpenAI's semantics: only a background response can be cancelled; while it runs it is cancelled
        (its turn too) and returned `cancelled`; a cancelled one is returned as it is (cancelling twice
        is idempotent); one that has ended otherwise is a 400."""
        r = stored(request, response_id)
        if not r.body.get("background"):
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id",
                           code="response_not_cancellable")
        if r.body["status"] in RUNNING:
            r = await cancel(r.tenant, response_id) or r
        if r.body["status"] != "cancelled":
            raise APIError(400, f"Cannot cancel a {r.body['status']} response.", param="response_id",
                           code="response_not_cancellable")
        return JSONResponse(r.body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        """Delete a stored response (a background one still running is cancelled first)."""
        tenant = request_tenant(request)
        await cancel(tenant, response_id)
        r, dropped = store.delete(tenant, response_id)
        if r is None:
            raise _not_found(response_id)
        await drop_sessions(dropped, patience=30.0)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return store


def response_object(turn: Turn, rid: str, created: int, model: str, output: list[dict], final: dict | None,
                    status: str = "in_progress") -> dict:
    """The response object (`status` until `final`, the turn's last event, is given)."""
    b = turn.body
    if final is not None:
        status = "incomplete" if final["finish_reason"] == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.store, "background": b.background, "temperature": b.temperature, "top_p": b.top_p,
            "top_logprobs": b.top_logprobs,
            "text": {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "truncation": b.truncation or "disabled", "metadata": b.metadata or {}, "user": None,
            "usage": None if final is None else response_usage(final)}


def _drop_oldest(conversation: list[dict]) -> list[dict]:
    """The conversation without its oldest message (and the tool results that answered it)."""
    rest = conversation[1:]
    while rest and rest[0]["role"] == "tool":
        rest = rest[1:]
    return rest


def _as_input(e: APIError) -> APIError:
    """An engine error about the prompt names the request's own field, `input`."""
    if e.param in ("prompt", "messages"):
        e.param = "input"
    return e


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", type="invalid_request_error",
                    param="response_id", code="response_not_found")
