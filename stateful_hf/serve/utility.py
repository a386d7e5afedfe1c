"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version, GET and POST /ping, in vLLM's
request and response shapes (`vllm/entrypoints/openai/protocol.py`: TokenizeCompletionRequest,
TokenizeChatRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse).

/tokenize takes a `prompt` (tokenized as given; `add_special_tokens` default true, as vLLM) or chat
`messages` (rendered as a chat completion renders them, tools and `chat_template_kwargs` included, so
that `count` is the chat's `usage.prompt_tokens`; `add_special_tokens` default false). The answer is
`{"count", "max_model_len", "tokens"}` and `token_strs` with `return_token_strs`. /detokenize takes
`tokens` and answers `{"prompt"}` (`tokenizer.decode`, special tokens kept). /version answers
`{"version"}` (stateful-hf's). /ping is vLLM's and SageMaker's health probe: an empty 200 while every
replica's engine runs, else 503 (as /health).

Parsing, rendering and tokenizing run in a worker thread, as the completions' do (app.py).
"""

from __future__ import annotations

from importlib.metadata import version as package_version
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from .protocol import APIError, ChatCompletionRequest
from .tool_parse import chat_prompt

CHAT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), one of them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None         # None: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def install(app, config, kit) -> None:
    """Add the routes to `app`. `kit`: the app's helpers (`parse`, `check_model`), a namespace since this
    module cannot import app.py (which imports it). Names the served model to the router's metrics
    (`RouterMetrics.model_name`: the `model_name` label of the vLLM series)."""
    tok = config.tokenizer
    app.state.router.metrics.model_name = config.model_name

    def chat_text(body: TokenizeRequest) -> str:
        """The prompt text a chat completion with these messages renders."""
        fields = {k: getattr(body, k) for k in CHAT_FIELDS if getattr(body, k) is not None}
        try:
            chat = ChatCompletionRequest.model_validate({"model": config.model_name, **fields})
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or "messages"
            raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None
        if body.add_generation_prompt and not body.continue_final_message:
            return chat_prompt(tok, chat)[0]
        if body.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message", code="invalid_value")
        if body.tools:
            raise APIError(400, "tools are rendered with the generation prompt only (add_generation_prompt true)",
                           param="tools", code="unsupported_parameter")
        try:
            return tok.apply_chat_template(chat.chat(), add_generation_prompt=False, tokenize=False,
                                           continue_final_message=body.continue_final_message,
                                           **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                           code="invalid_messages") from None

    def tokenize(raw: bytes) -> dict:
        body = kit.parse(raw, TokenizeRequest)
        kit.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give one of prompt (text) or messages (a chat)",
                           param="prompt" if body.prompt is None else "messages", code="invalid_value")
        text = body.prompt if body.messages is None else chat_text(body)
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        ids = list(tok(text, add_special_tokens=special)["input_ids"])
        out = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    def detokenize(raw: bytes) -> dict:
        body = kit.parse(raw, DetokenizeRequest)
        kit.check_model(body.model)
        vocab = len(tok)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in the vocabulary (0..{vocab - 1})", param="tokens",
                           code="invalid_value")
        return {"prompt": tok.decode(body.tokens)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return JSONResponse(await run_in_threadpool(tokenize, await request.body()))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return JSONResponse(await run_in_threadpool(detokenize, await request.body()))

    @app.get("/version")
    async def version():
        return JSONResponse({"version": package_version("stateful-hf")})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        replicas = await app.state.router.health()
        ok = all(r.get("engine_running", True) for r in replicas)
        return Response(status_code=200 if ok else 503)

