"""The HTTP app (FastAPI): OpenAI-compatible completions over a `Router` of engine replicas.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both stream with server-sent events when
`"stream": true`; chat's tools: tools.py, tool_parse.py), POST /v1/responses, GET and DELETE
/v1/responses/{id} (responses.py), POST /v1/hints, GET and DELETE /v1/sessions/{id}, GET /v1/models, GET /metrics,
GET /health. docs/server-api.md describes them.

The session of a request is, first found: the `X-Session-Id` header, the body's `session_id`. The
OpenAI `user` field is not a session (two conversations of one user would overwrite each other).
Without a session id the turn runs in a throwaway session of the caller's tenant, deleted when the
turn ends (it still reuses and feeds the shared prefixes of its tenant and `cache_salt`:
docs/prefix-sharing.md). `session_id_of` is the one place a request's session id is resolved:
sessions are named within the caller's tenant (`auth.py`: the API key's; `stateful_hf/cache/sessions/session.py`: the
store's key). `Access` (keys, limits) is enforced by
`auth.Guard` and `limits.TenantGate`; CORS (`CorsPreflight`, in front of Guard) when origins are allowed.
A request's parsing, chat-template rendering and tokenization run in a worker thread (`chat_turn`,
`completion_turn`): the event loop keeps answering /health and other streams meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache.sessions.tenant import session_key, split_key
from .auth import Access, Guard, request_tenant
from .choices import ChoiceGroup, ChoiceShape, SessionForks, answer
from .error_boundary import ErrorBoundary
from .limits import TenantGate
from .openapi import install as install_openapi
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    HintRequest,
    StreamLogprobs,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    max_tokens_for,
    new_id,
    usage,
)
from .request_body import parse
from .response_store import ResponseRetention
from .responses import install as install_responses
from .retain import retain_of
from .structured import constrain
from .tool_parse import chat_prompt, reply_reader
from .utility import install as install_utility

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID = 128
SESSION_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_SESSION_ID}}}")   # header, body and URL alike


class ServeConfig:
    """What the app needs besides the router: the model's name, its tokenizer (prompts are
    tokenized here, once), its context length (`--max-model-len`, at most the model's), the cap on a
    chat's default max_tokens (None: no cap, the room left in the context, as vLLM does), the model's
    generation config (where a request's unset sampling fields come from; None: library defaults),
    the seed of unseeded requests' seeds (`request_seeds`; None: each draws a fresh one) and the seconds
    a `response_format`'s grammar may take to compile (`structured.py`; None: no limit) and how long and
    how many stored responses the Responses API keeps (`responses`; None: `ResponseRetention()`)."""

    def __init__(self, model_name: str, tokenizer, max_model_len: int, default_max_tokens: int | None = None,
                 generation_config=None, seed: int | None = None, grammar_compile_timeout: float | None = 5.0,
                 responses: ResponseRetention | None = None):
        self.generation_config = generation_config
        self.responses = responses or ResponseRetention()
        self.grammar_compile_timeout = grammar_compile_timeout   # a response_format's compile, at most (s)
        if default_max_tokens is not None and default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1 or None, got {default_max_tokens}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        self.model_name, self.tokenizer = model_name, tokenizer
        self.max_model_len, self.default_max_tokens, self.seed = max_model_len, default_max_tokens, seed
        self.strict_fields = False               # --strict-fields: an unknown request field is a 400 (fields.py)


def request_seeds(seed: int) -> Iterator[int]:
    """The seeds requests without one get, in the order the server takes them (`--seed`)."""
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(63)


def encode(tokenizer, text: str, most: int) -> tuple[int, list[int] | None]:
    """(tokens, ids) of `tokenizer(text, add_special_tokens=False)`; ids None when there are more than
    `most` tokens. Through the Rust tokenizer without offsets when there is one: about 2x faster on a
    long text, and the GIL is held for milliseconds rather than the 0.1-0.3 s that building the Python
    ids and freeing the offsets of a 7 MB text take (so the event loop keeps answering)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):    # the latter: transformers' path
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return len(ids), ids if len(ids) <= most else None
    encoding = backend.encode_batch_fast([text], add_special_tokens=False)[0]
    return len(encoding), encoding.ids if len(encoding) <= most else None


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


class CorsPreflight(CORSMiddleware):
    """Starlette's CORS middleware, whose refused preflight is a 400 in OpenAI's shape naming the
    request header at fault (Starlette's own is plain text)."""

    HEADERS = {"origin": "Origin", "method": "Access-Control-Request-Method",
               "headers": "Access-Control-Request-Headers",
               "private-network": "Access-Control-Request-Private-Network"}

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ").split(", ")
        e = APIError(400, f"CORS preflight refused: this {', '.join(refused)} is not allowed (--allowed-origins, "
                     "--allowed-methods, --allowed-headers)", param=self.HEADERS.get(refused[0], "Origin"),
                     code="cors_not_allowed")
        kept = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return JSONResponse(e.body(), status_code=400, headers=kept)


def _as_chat(e: APIError, kind: str) -> APIError:
    """An engine error about the prompt names the chat's own field, `messages`."""
    if kind == "chat" and e.param == "prompt":
        e.param = "messages"
    return e


@contextlib.asynccontextmanager
async def _warm(app: FastAPI) -> AsyncIterator[None]:
    """Before the first request: the worker threads' pool and anyio's backend (imported by the first
    `run_in_threadpool`, ~0.3 s), so a restarted server's first turn does not pay them."""
    await run_in_threadpool(lambda: None)
    yield


def create_app(router, config: ServeConfig, access: Access | None = None) -> FastAPI:
    app = FastAPI(title="stateful-hf", docs_url=None, redoc_url=None, lifespan=_warm)
    app.state.router, app.state.config, app.state.access = router, config, access or Access()
    count_error = router.metrics.error                   # every error response, by status and code
    app.add_middleware(ErrorBoundary, on_error=count_error)   # a bug's 500, the connection kept (innermost)
    app.add_middleware(Guard, access=app.state.access, on_error=count_error)
    cors = app.state.access.cors
    if cors.origins:                                     # added last: outermost, before Guard
        app.add_middleware(CorsPreflight, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials,
                           expose_headers=["X-Session-Id", "X-Replica", "Retry-After"])
    limits = app.state.access.limits
    router = SessionForks(TenantGate(router, limits))      # a session's n > 1 choices, held (choices.py)
    tok = config.tokenizer
    seeds = None if config.seed is None else request_seeds(config.seed)

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

    def check_model(model: str | None) -> None:
        if model is not None and model != config.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{config.model_name}`",
                           param="model", code="model_not_found")

    def header_session(request: Request) -> str | None:
        named = request.headers.get(SESSION_HEADER) or None
        return None if named is None else session_id_of(request, named, "X-Session-Id")

    def seeded(body, sampling):
        """`sampling` with the server's next seed when the request has none (`--seed`)."""
        if seeds is None or body.seed is not None:
            return sampling
        return dataclasses.replace(sampling, seed=next(seeds))

    async def run(request: Request, body, ids, sampling, kind: str, reply=None, echo: str | None = None):
        """One turn answered as a response or a stream; `echo`: a completion's prompt text, sent first."""
        sid, retain = header_session(request), retain_of(request)
        if sid is None and body.session_id:
            sid = session_id_of(request, body.session_id)
        kept = router.retain if sid is not None and retain is not None else None     # after the turn ends
        sampling = seeded(body, sampling)
        stream, token_ids = body.stream, body.return_token_ids
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        rid, model, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), config.model_name, int(time.time())
        events = router.stream(sid, ids, sampling, cache_salt=body.cache_salt,
                               tenant=request_tenant(request) if sid is None else None)
        first = await anext(events, None)
        if first is None or first["type"] == "error":
            await events.aclose()
            if first is None:
                raise APIError(500, "no output", type="server_error")
            raise _as_chat(APIError.from_dict(first["error"]), kind)
        if not stream:
            final = first
            async with contextlib.aclosing(events):
                async for ev in events:
                    final = ev
            if final["type"] == "error":
                raise _as_chat(APIError.from_dict(final["error"]), kind)
            if kept is not None:
                await kept(sid, retain)
            body = chat_response(rid, model, final, token_ids, tok) if kind == "chat" else \
                completion_response(rid, model, final, token_ids, tok, echo)
            if reply is not None:                          # tools: the message's content and tool_calls
                choice = body["choices"][0]
                choice["message"], choice["finish_reason"] = reply.message(final["text"], final["finish_reason"])
                body["usage"] = usage(reply.counted(tok, final))
            return JSONResponse(body, headers={"X-Replica": str(final.get("replica", ""))})
        # logprobs: each chunk carries those of the tokens delivered since the last chunk (StreamLogprobs)
        lp = StreamLogprobs(kind == "chat", tok, sampling.logprobs is not None)
        if kind == "chat":
            piece = lambda text, reason=None, use=None, choices=True, logprobs=None: chat_chunk(
                rid, model, created, {"content": text} if text or reason is None else {}, reason, use, choices,
                logprobs)
        else:
            piece = lambda text, reason=None, use=None, choices=True, logprobs=None: completion_chunk(
                rid, model, created, text, reason, use, choices, logprobs=logprobs)

        async def sse() -> AsyncIterator[str]:
            async with contextlib.aclosing(events):
                if kind == "chat":
                    yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
                    for delta in reply.deltas("") if reply is not None else ():   # a call the prefill wrote whole
                        yield _sse(chat_chunk(rid, model, created, delta, logprobs=lp.take()))
                elif echo:
                    yield _sse(piece(echo))
                ev = first
                while ev is not None:
                    if ev["type"] == "delta":
                        lp.add(ev)
                    if ev["type"] == "delta" and ev["text"] and reply is not None:
                        for delta in reply.deltas(ev["text"]):     # held text: its logprobs wait with it
                            yield _sse(chat_chunk(rid, model, created, delta, logprobs=lp.take()))
                    elif ev["type"] == "delta" and ev["text"]:
                        yield _sse(piece(ev["text"], logprobs=lp.take()))
                    elif ev["type"] == "error":
                        yield _sse(_as_chat(APIError.from_dict(ev["error"]), kind).body())
                        break
                    elif ev["type"] == "done":
                        reason = ev["finish_reason"]
                        if reply is not None:
                            deltas, reason = reply.close(reason)
                            for delta in deltas:
                                yield _sse(chat_chunk(rid, model, created, delta, logprobs=lp.take()))
                        yield _sse(piece("", reason, logprobs=lp.take()))   # the rest (EOS, a stop's token)
                        if include_usage:
                            yield _sse(piece("", use=usage(ev if reply is None else reply.counted(tok, ev)),
                                             choices=False))
                        if kept is not None:
                            await kept(sid, retain)
                    ev = await anext(events, None)
                yield "data: [DONE]\n\n"

        shown = split_key(sid)[1] if sid else ""               # the caller's own id, not the store's key
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Session-Id": shown})

    def chat_turn(raw: bytes):
        """(body, prompt ids, sampling) of a chat request: parsed, checked, rendered and tokenized
        (in a worker thread: the event loop keeps answering)."""
        body = parse(raw, ChatCompletionRequest, config.strict_fields)
        check_session_id(body.session_id)
        check_model(body.model)
        body.refuse_unsupported()
        budget = "max_completion_tokens" if body.max_tokens is None and body.max_completion_tokens else "max_tokens"
        requested = body.requested_max_tokens()
        text, reply, stops = chat_prompt(tok, body)         # tools: tools.py, tool_parse.py
        plan = None if reply is None else reply.plan         # the turn's ToolPlan (None: no tools)
        if reply is not None and body.n > 1:                 # n choices: a reader each
            reply = [reply] + [reply_reader(tok, plan, text) for _ in range(body.n - 1)]
        n, ids = encode(tok, text, config.max_model_len)     # = apply_chat_template(tokenize=True)
        sampling = body.sampling(max_tokens_for(requested, n, config.max_model_len, config.default_max_tokens,
                                                "messages", budget), config.generation_config, len(tok))
        limits.check_prompt(n, config.max_model_len, "messages")
        sampling = constrain(dataclasses.replace(sampling, stop=sampling.stop + stops),   # its grammar compiled here
                             (body.model_extra or {}).get("response_format"), tok, config.grammar_compile_timeout,
                             plan)
        return body, ids, sampling, reply

    def completion_turn(raw: bytes):
        """(body, [(prompt ids, sampling, echo text or None) per prompt]) of a completion request (in a
        worker thread, as `chat_turn`)."""
        body = parse(raw, CompletionRequest, config.strict_fields)
        check_session_id(body.session_id)
        check_model(body.model)
        body.refuse_unsupported()
        requested = body.requested_max_tokens()
        turns = []
        for prompt in body.prompts():
            n, ids = encode(tok, prompt, config.max_model_len) if isinstance(prompt, str) else (len(prompt),
                                                                                                list(prompt))
            if not n:
                raise APIError(400, "the prompt has no tokens", param="prompt", code="invalid_value")
            # OpenAI's default for completions is 16 tokens (less if the context has less room)
            sampling = body.sampling(max_tokens_for(requested, n, config.max_model_len, 16, "prompt"),
                                     config.generation_config, len(tok))
            limits.check_prompt(n, config.max_model_len, "prompt")
            turns.append((ids, sampling, (prompt if isinstance(prompt, str) else tok.decode(ids)) if body.echo
                          else None))
        return body, turns

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        header_session(request)                          # a bad header is refused before any work
        body, ids, sampling, reply = await run_in_threadpool(chat_turn, await request.body())
        if body.n > 1:
            return await run_choices(request, body, [(ids, sampling, None)], "chat", reply)
        return await run(request, body, ids, sampling, "chat", reply)

    @app.post("/v1/completions")
    async def completions(request: Request):
        header_session(request)
        body, turns = await run_in_threadpool(completion_turn, await request.body())
        if len(turns) > 1 and (header_session(request) is not None or body.session_id):
            raise APIError(400, "a list of prompts runs without a session (a session holds one conversation); send "
                           "one prompt per request with a session id", param="prompt", code="invalid_value")
        if body.n > 1 or len(turns) > 1:                 # each prompt's n choices (choices.py)
            return await run_choices(request, body, turns, "completion")
        return await run(request, body, *turns[0][:2], "completion", echo=turns[0][2])

    async def run_choices(request: Request, body, turns: list, kind: str, readers: list | None = None):
        """`n` > 1 or a list of prompts (choices.py): each prompt's n choices as forks of it, `index`
        prompt-major, the prompts run together; with a session id (one prompt) its choices are held until the
        session's next turn."""
        sid, retain = header_session(request), retain_of(request)
        if sid is None and body.session_id:
            sid = session_id_of(request, body.session_id)
        n = body.n
        groups = [ChoiceGroup(tuple(ids), seeded(body, sampling), n, sid, p * n, echo)
                  for p, (ids, sampling, echo) in enumerate(turns)]

        async def on_done() -> None:          # X-Session-Retain: the session and its held choices
            held = router.held(sid)
            for key in (held.keys if held is not None else (sid,)):
                await router.retain(key, retain)
        shape = ChoiceShape(kind, config.model_name, tok, body.return_token_ids,
                            bool(body.stream_options and body.stream_options.include_usage), readers,
                            on_done if sid is not None and retain is not None else None)
        out, events = await answer(router, groups, shape, body.stream, rid=new_id("chatcmpl" if kind == "chat"
                                                                                  else "cmpl"),
                                   cache_salt=body.cache_salt, tenant=request_tenant(request) if sid is None else None)
        if events is None:
            return JSONResponse(out, headers={"X-Replica": out.pop("replica")})
        shown = split_key(sid)[1] if sid else ""
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Session-Id": shown})

    @app.post("/v1/hints")
    async def hints(request: Request):
        body = await run_in_threadpool(parse, await request.body(), HintRequest)
        check_model(body.model)
        out = await router.hint(session_id_of(request, body.session_id), body.expected_arrival, body.priority)
        return JSONResponse({**out, "session_id": body.session_id})

    @app.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str):
        return JSONResponse(await router.session_info(session_id_of(request, session_id)))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str):
        return JSONResponse(await router.delete_session(session_id_of(request, session_id)))

    install_responses(app, router, config, SimpleNamespace(       # /v1/responses: responses.py
        parse=parse, encode=encode, check_model=check_model, seeded=seeded,
        check_session_id=check_session_id, header_session=header_session, limits=limits))
    install_utility(app, config, SimpleNamespace(parse=parse, check_model=check_model))   # /tokenize, /ping ...

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

    install_openapi(app, config.model_name, SESSION_ID)       # /openapi.json: request bodies and errors (openapi.py)
    return app


def check_session_id(named: str | None, param: str = "session_id") -> None:
    """A session id a client sends is 1-128 letters, digits, '.', '_', ':' or '-' (else 400 naming
    `param`); None or "" is no id."""
    if not named:
        return
    if not SESSION_ID.fullmatch(named):
        shown = repr(named[:40]) + ("..." if len(named) > 40 else "")
        raise APIError(400, f"{param} must be 1-{MAX_SESSION_ID} characters of letters, digits, '.', '_', ':' or "
                       f"'-'; got {shown} ({len(named)} characters)", param=param, code="invalid_session_id")


def session_id_of(request: Request, named: str, param: str = "session_id") -> str:
    """The store's key of the session a client names (header, body or URL), within the caller's tenant.
    The single place ids are resolved, so every endpoint sees the same scoping and the same rule
    (`check_session_id`; an empty id is refused here too)."""
    if not named:
        raise APIError(400, f"{param} is empty", param=param, code="invalid_session_id")
    check_session_id(named, param)
    return session_key(request_tenant(request), named)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
