"""The HTTP app (FastAPI): OpenAI-compatible completions over a `Router` of engine replicas.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both stream with server-sent events when
`"stream": true`), POST /v1/hints, GET and DELETE /v1/sessions/{id}, GET /v1/models, GET /metrics,
GET /health. docs/server-api.md describes them.

The session of a request is, first found: the `X-Session-Id` header, the body's `session_id`. The
OpenAI `user` field is not a session (two conversations of one user would overwrite each other).
Without a session id the turn runs in a throwaway session of the caller's tenant, deleted when the
turn ends (it still reuses and feeds the shared prefixes of its tenant and `cache_salt`:
docs/prefix-sharing.md). `session_id_of` is the one place a request's session id is resolved:
sessions are named within the caller's tenant (`auth.py`: the API key's; `stateful_hf/cache/tenant.py`: the
store's key). `Access` (keys, limits) is enforced by
`auth.Guard` and `limits.TenantGate`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache.tenant import session_key, split_key
from .auth import Access, Guard, request_tenant
from .limits import TenantGate
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    HintRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    usage,
)

SESSION_HEADER = "x-session-id"


class ServeConfig:
    """What the app needs besides the router: the model's name, its tokenizer (prompts are
    tokenized here, once), its context length, the cap on a chat's default max_tokens (None: no cap,
    the room left in the context, as vLLM does) and the model's generation config (where a request's
    unset sampling fields come from; None: library defaults)."""

    def __init__(self, model_name: str, tokenizer, max_model_len: int, default_max_tokens: int | None = None,
                 generation_config=None):
        self.generation_config = generation_config
        if default_max_tokens is not None and default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1 or None, got {default_max_tokens}")
        self.model_name, self.tokenizer = model_name, tokenizer
        self.max_model_len, self.default_max_tokens = max_model_len, default_max_tokens


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int, cap: int | None, param: str) -> int:
    """A turn's max_tokens. Precedence: the request's field; else the room left in the context
    (max_model_len - prompt), capped by `cap` when the server has one. Too long: 400."""
    room = max_model_len - prompt_len
    if requested is None:
        if room >= 1:
            return room if cap is None else min(room, cap)
        requested = 1                        # the prompt alone fills the context: report it as below
    if prompt_len + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                       "for the completion). Please reduce the prompt or max_tokens.", param=param,
                       code="context_length_exceeded")
    return requested


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


async def _parse(request: Request, model_cls):
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param,
                       code="missing_required_parameter" if err["type"] == "missing" else "invalid_value") from None


def create_app(router, config: ServeConfig, access: Access | None = None) -> FastAPI:
    app = FastAPI(title="stateful-hf", docs_url=None, redoc_url=None)
    app.state.router, app.state.config, app.state.access = router, config, access or Access()
    count_error = router.metrics.error                   # every error response, by status and code
    app.add_middleware(Guard, access=app.state.access, on_error=count_error)
    limits = app.state.access.limits
    router = TenantGate(router, limits)
    tok = config.tokenizer

    def respond(e: APIError) -> JSONResponse:
        count_error(e)
        return _error_response(e)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return respond(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return respond(APIError(e.status_code, str(e.detail), type=kind, code=kind))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        return respond(APIError(500, f"{type(e).__name__}: {e}", type="server_error", code="internal_error"))

    def check_model(model: str | None) -> None:
        if model is not None and model != config.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{config.model_name}`",
                           param="model", code="model_not_found")

    def session_of(request: Request, body) -> str | None:
        named = request.headers.get(SESSION_HEADER) or body.session_id or None
        return None if named is None else session_id_of(request, named)

    async def run(request: Request, body, ids, sampling, kind: str):
        sid = session_of(request, body)
        stream, token_ids = body.stream, body.return_token_ids
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        rid, model, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), config.model_name, int(time.time())
        events = router.stream(sid, ids, sampling, cache_salt=body.cache_salt,
                               tenant=request_tenant(request) if sid is None else None)
        first = await anext(events, None)
        if first is None or first["type"] == "error":
            await events.aclose()
            raise APIError.from_dict(first["error"]) if first else APIError(500, "no output", type="server_error")
        if not stream:
            final = first
            async with contextlib.aclosing(events):
                async for ev in events:
                    final = ev
            if final["type"] == "error":
                raise APIError.from_dict(final["error"])
            body = (chat_response if kind == "chat" else completion_response)(rid, model, final, token_ids, tok)
            return JSONResponse(body, headers={"X-Replica": str(final.get("replica", ""))})
        if kind == "chat":
            piece = lambda text, reason=None, use=None, choices=True: chat_chunk(
                rid, model, created, {"content": text} if text or reason is None else {}, reason, use, choices)
        else:
            piece = lambda text, reason=None, use=None, choices=True: completion_chunk(
                rid, model, created, text, reason, use, choices)

        async def sse() -> AsyncIterator[str]:
            async with contextlib.aclosing(events):
                if kind == "chat":
                    yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
                ev = first
                while ev is not None:
                    if ev["type"] == "delta" and ev["text"]:
                        yield _sse(piece(ev["text"]))
                    elif ev["type"] == "error":
                        yield _sse(APIError.from_dict(ev["error"]).body())
                        break
                    elif ev["type"] == "done":
                        yield _sse(piece("", ev["finish_reason"]))
                        if include_usage:
                            yield _sse(piece("", use=usage(ev), choices=False))
                    ev = await anext(events, None)
                yield "data: [DONE]\n\n"

        shown = split_key(sid)[1] if sid else ""               # the caller's own id, not the store's key
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Session-Id": shown})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        check_model(body.model)
        body.refuse_unsupported()
        if body.logprobs and body.stream:
            raise APIError(400, "logprobs are returned by non-streaming requests only; set stream to false",
                           param="logprobs", code="unsupported_parameter")
        requested = body.requested_max_tokens()
        try:
            ids = list(tok.apply_chat_template(body.chat(), add_generation_prompt=True, tokenize=True)["input_ids"])
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                           code="invalid_messages") from None
        sampling = body.sampling(max_tokens_for(requested, len(ids), config.max_model_len,
                                                config.default_max_tokens, "messages"), config.generation_config)
        limits.check_prompt(len(ids), config.max_model_len, "messages")
        return await run(request, body, ids, sampling, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        check_model(body.model)
        body.refuse_unsupported()
        requested = body.requested_max_tokens()
        prompt = body.prompt_one()
        ids = tok(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "the prompt has no tokens", param="prompt", code="invalid_value")
        # OpenAI's default for completions is 16 tokens (less if the context has less room)
        default = requested if requested is not None else max(min(16, config.max_model_len - len(ids)), 1)
        sampling = body.sampling(max_tokens_for(default, len(ids), config.max_model_len, None, "prompt"),
                                 config.generation_config)
        limits.check_prompt(len(ids), config.max_model_len, "prompt")
        return await run(request, body, ids, sampling, "completion")

    @app.post("/v1/hints")
    async def hints(request: Request):
        body = await _parse(request, HintRequest)
        check_model(body.model)
        out = await router.hint(session_id_of(request, body.session_id), body.expected_arrival, body.priority)
        return JSONResponse({**out, "session_id": body.session_id})

    @app.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str):
        return JSONResponse(await router.session_info(session_id_of(request, session_id)))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str):
        return JSONResponse(await router.delete_session(session_id_of(request, session_id)))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "stateful-hf", "max_model_len": config.max_model_len}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = await router.metrics_page(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health():
        replicas = await router.health()
        ok = all(r.get("engine_running", True) for r in replicas)
        return JSONResponse({"status": "ok" if ok else "unhealthy", "model": config.model_name, "replicas": replicas},
                            status_code=200 if ok else 503)

    return app


def session_id_of(request: Request, named: str) -> str:
    """The store's key of the session a client names (header, body or URL), within the caller's tenant.
    The single place ids are resolved, so every endpoint sees the same scoping."""
    if not named:
        raise APIError(400, "the session id is empty", param="session_id", code="invalid_value")
    return session_key(request_tenant(request), named)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
