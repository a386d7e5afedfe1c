"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (docs/agents.md).

A response runs as one turn of a session, like a chat completion. Its session: the client's
(`X-Session-Id` or the body's `session_id`) when named; else, continuing a stored response
(`previous_response_id`), that response's session for its first continuation whose prompt extends the
response's, and a new session for any other (a fork: it starts from the prefix the store shares, so a
continuation with other `instructions` never cuts the chain's history; `response_store.py`); else a new
session named by the server (`resp_...`), or a throwaway one when the response is not stored
(`store: false`). The prompt is the whole conversation rendered through the chat template (tools:
`tools.py`), so the session reuses what it holds and only the new input is prefilled.

Items and events: `response_items.py`; stored responses: `response_store.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from .auth import request_tenant
from .protocol import APIError, max_tokens_for, sampling_params
from .reasoning import reasons, with_reasoning_tokens
from .response_items import OutputBuilder, input_messages, item_id, reply_message, response_usage
from .response_store import PromptKey, ResponseStore, StoredResponse
from .retain import retain_of
from .structured import constrain
from .tool_parse import ReplyParser, prompt_for, reply_template_of
from .tools import ToolPlan, check_tool_choice, check_tools


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
    metadata: dict | None = None
    text: dict | None = None
    session_id: str | None = None                           # extension, as chat's
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def refuse_unsupported(self) -> None:
        """A text format other than text is a 400 naming `text.format` (the other refused fields: fields.py)."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") != "text":
            raise APIError(400, "`text.format` is not supported by this server; remove it from the request",
                           param="text.format", code="unsupported_parameter")

    def sampling(self, max_tokens: int, generation_config, stop: tuple[str, ...]) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
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

    async def drop_sessions(sessions: list[str]) -> None:
        for sid in sessions:
            with contextlib.suppress(APIError):
                await router.delete_session(sid)

    def counted(final: dict, parser: ReplyParser | None) -> dict:
        """`final` with its `reasoning_tokens` where the template reasons (usage's output_tokens_details)."""
        reasoned = bool(parser.reasoning) if parser is not None and reasons(tok) else None
        return with_reasoning_tokens(tok, final, reasoned)

    def finish(turn: Turn, rid: str, created: int, builder: OutputBuilder, final: dict) -> dict:
        obj = response_object(turn, rid, created, config.model_name, builder.items, final)
        if turn.body.store:
            stored = StoredResponse(rid, turn.tenant, turn.sid, turn.owns_session,
                                    turn.conversation + [reply_message(builder.items)], obj,
                                    prompt=PromptKey.of(turn.ids))
            dropped = store.put(stored)
            if dropped:
                asyncio.get_running_loop().create_task(drop_sessions(dropped))
        return obj

    @app.post("/v1/responses")
    async def create_response(request: Request):
        named, retain = kit.header_session(request), retain_of(request)
        tenant = request_tenant(request)
        turn = await run_in_threadpool(prepare, await request.body(), tenant, named)
        rid, created = item_id("resp"), int(time.time())
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
            async with contextlib.aclosing(events):
                ev = first
                while ev is not None:
                    if ev["type"] == "delta":
                        for e in builder.add(pieces(ev["text"])):
                            yield emit(e)
                    elif ev["type"] == "error":
                        err = _as_input(APIError.from_dict(ev["error"]))
                        yield emit({"type": "error", "code": err.code, "message": err.message, "param": err.param})
                        return
                    elif ev["type"] == "done":
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

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        r, dropped = store.delete(request_tenant(request), response_id)
        if r is None:
            raise _not_found(response_id)
        await drop_sessions(dropped)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return store


def response_object(turn: Turn, rid: str, created: int, model: str, output: list[dict], final: dict | None) -> dict:
    """The response object (status in_progress until `final`, the turn's last event, is given)."""
    b = turn.body
    status = "in_progress" if final is None else "incomplete" if final["finish_reason"] == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
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
