"""OpenAI-compatible request and response bodies, and OpenAI-style errors.

Requests are validated with pydantic (the body first by `request_body.parse`: nesting depth, lone
surrogates, non-finite numbers); anything invalid becomes an `APIError` with the status code and body
OpenAI uses: `{"error": {"message", "type", "param", "code"}}`. Field ranges are declared on the models
(so `/openapi.json` states them, `openapi.py`); `sampling_params` maps a request's sampling fields to the
engine's, a degenerate distribution to greedy (`SAMPLING_FLOOR`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..engine import SamplingParams
from ..engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY


class APIError(Exception):
    """An error the server reports to the client (never a bug: those are 500s)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after           # seconds: sent as the Retry-After header

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict:              # crosses process boundaries (Ray) as plain data
        return {"status": self.status, **self.body()["error"], "retry_after": self.retry_after}

    @classmethod
    def from_dict(cls, d: dict) -> APIError:
        return cls(d["status"], d["message"], d["type"], d.get("param"), d.get("code"), d.get("retry_after"))


INT64 = (-2**63, 2**63 - 1)   # OpenAI's integer range (a seed must fit a torch generator's int64)
MAX_N = 128                  # OpenAI's bound on n
MAX_PROMPTS = 128            # prompts in one completions request (each its own turn)
# Below this, a temperature or top_p leaves one token (float32 logits / temperature overflow to inf, and
# a top_p under float32's smallest value rounds to 0, so sampling would see nan): the turn is greedy.
# vLLM's _SAMPLING_EPS, for temperature.
SAMPLING_FLOOR = 1e-5
MAX_EXPECTED_ARRIVAL = 86400.0   # a hint's expected_arrival (s): one day (the store keeps --max-retain of it)


def sampling_params(generation_config, **explicit) -> SamplingParams:
    """`SamplingParams.from_generation_config(generation_config, **explicit)`, greedy when its
    temperature or top_p is under `SAMPLING_FLOOR` (both would keep the top token only: docs/server-api.md).
    A seed outside int64 is a 400 naming `seed` (models that do not bound it: the Responses API's)."""
    seed = explicit.get("seed")
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise APIError(400, f"seed must be an int64 (in [{INT64[0]}, {INT64[1]}]), got {seed}", param="seed",
                       code="invalid_value")
    p = SamplingParams.from_generation_config(generation_config, **explicit)
    if not p.greedy and (p.temperature < SAMPLING_FLOOR or p.top_p < SAMPLING_FLOOR):
        p = dataclasses.replace(p, temperature=0.0, top_p=1.0)
    return p


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Extra OpenAI fields we do not act on are accepted and ignored
    (`extra="allow"`), except the ones that would change the answer's shape (checked below)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT64[1])
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT64[1])   # extension (vLLM spelling); 0 = off
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None        # extension
    ignore_eos: bool = False                       # extension
    # penalties and filters (engine/sampling.py; unset: the model's generation config, then off)
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0)   # extensions (vLLM spelling)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0, le=INT64[1])
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None    # only with stream: true (as OpenAI)
    user: str | None = None
    session_id: str | None = None                  # extension: the conversation's session (see README)
    return_token_ids: bool = False                 # extension (vLLM spelling): choices[0].token_ids
    # vLLM's: will scope prefix sharing across sessions (not built yet); validated, no effect today
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not all(0 <= t <= INT64[1] for t in v):
            raise ValueError("token ids are non-negative int64 values")
        return v

    def requested_max_tokens(self) -> int | None:
        """The request's own max_tokens (None: the server picks, see `max_tokens_for`)."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens",
                           code="invalid_value")
        return self.max_tokens

    def refuse_unsupported(self) -> None:
        """A 400 naming a field whose combination with others asks for what this server does not do
        (each field alone is checked against fields.py's list, when the body is parsed)."""

    def sampling(self, max_tokens: int, generation_config=None, vocab_size: int | None = None) -> SamplingParams:
        """The turn's SamplingParams. Precedence (docs/errors.md): the fields this request set, then
        the model's generation config (greedy unless it sets do_sample=True), then library defaults.
        `vocab_size`: the tokenizer's; a `logit_bias` token id at or past it is a 400 naming the field."""
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens",
                           code="invalid_value")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not all(stops):
            raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                 "stop": (self.stop,) if isinstance(self.stop, str) else _tuple(self.stop),
                 "stop_token_ids": _tuple(self.stop_token_ids), "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                 "min_p": self.min_p, "min_tokens": self.min_tokens, "logit_bias": self.logit_bias}
        explicit = {k: v for k, v in given.items() if v is not None}
        try:
            p = sampling_params(generation_config, max_new_tokens=max_tokens, ignore_eos=self.ignore_eos, **explicit)
        except ValueError as e:       # a field the checks above do not cover: named by SamplingParams' message
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=_REQUEST_FIELD.get(field, field), code="invalid_value") from None
        outside = [t for t, _ in p.logit_bias if vocab_size is not None and t >= vocab_size]
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is out of the vocabulary (ids 0..{vocab_size - 1})",
                           param="logit_bias", code="invalid_value")
        return p


# SamplingParams' field -> the request's
_REQUEST_FIELD = {"max_new_tokens": "max_tokens", "logprobs": "top_logprobs", "stop_token_ids": "stop_token_ids"}


def _tuple(values: list | None) -> tuple | None:
    return None if values is None else tuple(values)


class ContentPart(BaseModel):
    """A part of a message's content: only `text` parts are served (`ChatMessage.text`); a text part's
    `text` is a string."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Any = Field(default=None, validate_default=True)

    @field_validator("text")
    @classmethod
    def _text_is_a_string(cls, v: Any, info: ValidationInfo) -> Any:
        if info.data.get("type") == "text" and not isinstance(v, str):
            raise ValueError("a text part's text must be a string")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.type != "text":
                raise APIError(400, f"only text content parts are supported, got {p.type!r}",
                               param="messages", code="unsupported_content")
            parts.append(p.text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64[1])
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None                             # checked by tools.check_tools (400s name the field)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")

    def sampling(self, max_tokens: int, generation_config=None, vocab_size: int | None = None) -> SamplingParams:
        p = super().sampling(max_tokens, generation_config, vocab_size)
        return dataclasses.replace(p, logprobs=self.top_logprobs or 0) if self.logprobs else p

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().requested_max_tokens()

    def chat(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False                            # the prompt's text before the completion's
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # legacy: that many alternatives

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs asks for the prompt's log-probabilities, which this server does "
                           "not compute; drop echo or logprobs", param="echo", code="unsupported_parameter")

    def sampling(self, max_tokens: int, generation_config=None, vocab_size: int | None = None) -> SamplingParams:
        p = super().sampling(max_tokens, generation_config, vocab_size)
        return p if self.logprobs is None else dataclasses.replace(p, logprobs=self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompts (each a string or token ids): one, or a list of 1 to `MAX_PROMPTS`, each answered
        as its own choice."""
        p = self.prompt
        many = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(many) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(many)}", param="prompt",
                           code="invalid_value")
        if not all(many):
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return many


class HintRequest(BaseModel):
    """Symphony's advisory request: `session_id` will send a turn soon."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    session_id: str = Field(min_length=1)
    expected_arrival: float | None = Field(default=None, ge=0, le=MAX_EXPECTED_ARRIVAL)   # seconds from now, if known
    priority: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    model: str | None = None


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int, cap: int | None, param: str,
                   budget_param: str = "max_tokens") -> int:
    """A turn's max_tokens. Precedence: the request's field; else the room left in the context
    (max_model_len - prompt), capped by `cap` when the server has one. Too long: 400 naming `param`
    (the prompt's field) when the prompt alone fills the context, else `budget_param` (the request's
    max_tokens field)."""
    room = max_model_len - prompt_len
    if requested is None:
        if room >= 1:
            return room if cap is None else min(room, cap)
        requested = 1                        # the prompt alone fills the context: report it as below
    if prompt_len + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"you requested {prompt_len + requested} tokens ({prompt_len} in the {param}, {requested} "
                       f"for the completion). Please reduce the length of the {param} or {budget_param}.",
                       param=param if room < 1 else budget_param, code="context_length_exceeded")
    return requested


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: dict) -> dict:
    """OpenAI usage; reuse is reported as `prompt_tokens_details.cached_tokens`, and a reasoning model's
    think block (`out["reasoning_tokens"]`, where counted) as `completion_tokens_details.reasoning_tokens`."""
    use = {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
           "total_tokens": out["prompt_tokens"] + out["completion_tokens"],
           "prompt_tokens_details": {"cached_tokens": out["reused_tokens"]}}
    if "reasoning_tokens" in out:
        use["completion_tokens_details"] = {"reasoning_tokens": out["reasoning_tokens"]}
    return use


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               use: dict | None = None, choices: bool = True, logprobs: dict | None = None) -> dict:
    """`logprobs`: the choice's, of the tokens whose text this chunk completes (`chat_logprobs`)."""
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
            if choices else []}
    if use is not None:
        body["usage"] = use
    return body


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     use: dict | None = None, choices: bool = True, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    """`logprobs`: the choice's, of the tokens whose text this chunk completes (`completion_logprobs`)."""
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
            if choices else []}
    if use is not None:
        body["usage"] = use
    return body


def chat_logprobs(out: dict, tokenizer) -> dict | None:
    """OpenAI's choice.logprobs of a chat reply: per generated token its text, log-probability, UTF-8
    bytes and the most likely alternatives (None when the request did not ask)."""
    if out.get("logprobs") is None:
        return None

    def entry(t: int, lp: float) -> dict:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                        for t, lp, alts in out["logprobs"]], "refusal": None}


class StreamLogprobs:
    """The logprobs of one streamed choice: the entries its delta events deliver (`"logprobs"`: the tokens
    whose text the event's text completes) wait for the choice's next chunk, which takes them all, in the
    endpoint's shape (`chat_logprobs`, or `completion_logprobs` with the text offsets running on); so the
    chunks' logprobs concatenate to the non-streaming answer's. `asked` False: every chunk's is None."""

    def __init__(self, chat: bool, tokenizer, asked: bool):
        self.chat, self.tokenizer, self.asked = chat, tokenizer, asked
        self.pending: list = []            # wire entries delivered, not yet in a chunk
        self.offset = 0                    # completions: the text offset of the next token

    def add(self, event: dict) -> None:
        self.pending += event.get("logprobs") or ()

    def take(self) -> dict | None:
        if not self.asked:
            return None
        entries, self.pending = self.pending, []
        if self.chat:
            return chat_logprobs({"logprobs": entries}, self.tokenizer)
        out = completion_logprobs({"logprobs": entries}, self.tokenizer, self.offset)
        assert out is not None
        self.offset += sum(map(len, out["tokens"]))
        return out


def chat_response(rid: str, model: str, out: dict, token_ids: bool = False, tokenizer=None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
              "logprobs": chat_logprobs(out, tokenizer), "finish_reason": out["finish_reason"]}
    if token_ids:
        choice["token_ids"] = out["token_ids"]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(out)}


def completion_logprobs(out: dict, tokenizer, offset: int = 0) -> dict | None:
    """OpenAI's legacy choice.logprobs of a completion (None when the request did not ask): per
    generated token its text, log-probability, the most likely alternatives with the chosen token
    (a text -> logprob map, as vLLM) and its text's offset (from `offset`: an echoed prompt's length)."""
    if out.get("logprobs") is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp, alts in out["logprobs"]:
        text = tokenizer.decode([t])
        top = {tokenizer.decode([a]): alp for a, alp in alts}
        top.setdefault(text, lp)
        tokens.append(text)
        lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def completion_response(rid: str, model: str, out: dict, token_ids: bool = False, tokenizer=None,
                        echo: str | None = None) -> dict:
    """`echo`: the prompt's text, put before the completion's."""
    choice = {"index": 0, "text": (echo or "") + out["text"], "logprobs": completion_logprobs(out, tokenizer),
              "finish_reason": out["finish_reason"]}
    if token_ids:
        choice["token_ids"] = out["token_ids"]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(out)}
