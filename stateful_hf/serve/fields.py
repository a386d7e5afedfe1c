"""Every request field of OpenAI's chat completions, completions and Responses APIs and of vLLM's
extensions, each with what this server does with it (`FieldStatus`): the one list requests are checked against.

- IMPLEMENTED: the server acts on it (protocol.py, tools.py, structured.py, responses.py).
- REFUSED: not done yet; set to a value that asks for something (anything but its `inert` values) it is
  a 400 naming it (`unsupported_parameter`), never a 200 that silently ignores it. Implementing one is
  a one-line change here (its status), beside the code that does it.
- HARMLESS: no effect on the answer by design (`user`, `metadata`, scheduling hints); accepted.

A field in none of the lists of its endpoint is dropped with a warning naming it, once per field name
(vLLM's behaviour); with `--strict-fields` it is a 400 naming it (OpenAI's). `check` runs on the raw JSON
object before the request model parses it (app.py's `_parse`). Combinations (`echo` with `logprobs`,
`top_logprobs` without `logprobs`) and values (ranges) are the request models' checks, not this list's.
docs/server-api.md lists the fields (checked against this list by tests/test_serve_fields.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import Enum

from .protocol import APIError

log = logging.getLogger(__name__)


class FieldStatus(Enum):
    IMPLEMENTED = "implemented"
    REFUSED = "refused"
    HARMLESS = "harmless"


class Endpoint(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One request field of one endpoint. `inert`: the values that ask for nothing (what the server does
    anyway; a REFUSED field set to one of them is accepted); `example`: a value that asks for something
    (the tests' walk sends it); `origin`: "openai", "vllm" or "stateful-hf"; `note`: what it does here,
    or why it is refused or harmless."""

    name: str
    endpoint: Endpoint
    status: FieldStatus
    origin: str
    note: str
    example: object = None
    inert: tuple = (None,)


IMPL, REFD, HARM = FieldStatus.IMPLEMENTED, FieldStatus.REFUSED, FieldStatus.HARMLESS
CHAT, COMPLETIONS, RESPONSES = Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES
_NO = (None, False, 0, 0.0, "", (), [], {})     # inert for most refused fields
_ONE = (None, 1, 1.0)

# (name, status, origin, note, example, inert) per endpoint; the order is docs/server-api.md's
_SAMPLING = [     # chat and completions alike
    ("model", IMPL, "openai", "must name the served model (404 otherwise)", "another-model", (None,)),
    ("max_tokens", IMPL, "openai", "the most tokens generated", 3, (None,)),
    ("temperature", IMPL, "openai", "0-2; unset: the model's generation config", 1.5, (None,)),
    ("top_p", IMPL, "openai", "(0, 1]", 0.05, (None,)),
    ("seed", IMPL, "openai", "a seeded request's tokens are the same alone and in a batch", 7, (None,)),
    ("stop", IMPL, "openai", "stop strings (the text is cut before them)", ["\n"], (None, [], "")),
    ("stream", IMPL, "openai", "server-sent events", True, (None, False)),
    ("stream_options", IMPL, "openai", "`include_usage`: a last chunk with the usage", {"include_usage": True},
     (None,)),
    ("n", IMPL, "openai", "1-128 choices, forks of one prompt computed once (seed: choice i uses seed + i)", 2,
     (None,)),
    ("presence_penalty", IMPL, "openai", "[-2, 2], over the generated tokens (as vLLM)", 0.5, (None,)),
    ("frequency_penalty", IMPL, "openai", "[-2, 2], per occurrence in the generated tokens (as vLLM)", 0.5, (None,)),
    ("logit_bias", IMPL, "openai", "token id -> [-100, 100] added to its logit (ids in the vocabulary)",
     {"42": 5}, (None,)),
    ("user", HARM, "openai", "not a session (docs/prefix-sharing.md); no effect", "alice", (None,)),
    ("top_k", IMPL, "vllm", "0: off", 1, (None,)),
    ("stop_token_ids", IMPL, "vllm", "token ids that end the turn (kept in token_ids)", [5], (None, [])),
    ("ignore_eos", IMPL, "vllm", "generate past EOS up to max_tokens", True, (None, False)),
    ("return_token_ids", IMPL, "vllm", "choices[0].token_ids", True, (None, False)),
    ("cache_salt", IMPL, "vllm", "scopes prefix sharing (docs/prefix-sharing.md)", "salt-1", (None,)),
    ("session_id", IMPL, "stateful-hf", "the session (as the X-Session-Id header)", "walk-1", (None, "")),
    ("best_of", REFD, "vllm", "one candidate per request", 2, _ONE),
    ("use_beam_search", REFD, "vllm", "no beam search", True, _NO),
    ("length_penalty", REFD, "vllm", "beam search only", 0.5, _ONE),
    ("min_p", IMPL, "vllm", "[0, 1], sampling only (as transformers' min_p)", 0.5, (None,)),
    ("repetition_penalty", IMPL, "vllm", "> 0, over prompt and generated tokens (as transformers')", 1.3, (None,)),
    ("min_tokens", IMPL, "vllm", "EOS and stop_token_ids held back until this many tokens", 4, (None,)),
    ("include_stop_str_in_output", REFD, "vllm", "the text is cut before a stop string", True, _NO),
    ("skip_special_tokens", REFD, "vllm", "special tokens are always skipped in the text", False, (None, True)),
    ("spaces_between_special_tokens", REFD, "vllm", "the tokenizer's decoding only", False, (None, True)),
    ("truncate_prompt_tokens", REFD, "vllm", "a prompt too long is a 400, never cut", 8, (None,)),
    ("truncation_side", REFD, "vllm", "no prompt truncation", "left", (None,)),
    ("allowed_token_ids", REFD, "vllm", "no token masks yet", [5, 6], _NO),
    ("bad_words", REFD, "vllm", "no token masks yet", ["a"], _NO),
    ("prompt_logprobs", REFD, "vllm", "no prompt log-probabilities", 1, (None,)),
    ("logprob_token_ids", REFD, "vllm", "no log-probabilities of chosen ids", [5], _NO),
    ("logits_processors", REFD, "vllm", "no custom logits processors", ["m.P"], _NO),
    ("return_tokens_as_token_ids", REFD, "vllm", "tokens are text", True, _NO),
    ("structured_outputs", REFD, "vllm", "use response_format (chat)", {"json": {"type": "object"}}, _NO),
    ("guided_json", REFD, "vllm", "use response_format (chat)", {"type": "object"}, _NO),
    ("guided_regex", REFD, "vllm", "no regex constraints", "a+", _NO),
    ("guided_choice", REFD, "vllm", "no choice constraints", ["a", "b"], _NO),
    ("guided_grammar", REFD, "vllm", "no grammar constraints", "root ::= \"a\"", _NO),
    ("guided_decoding_backend", REFD, "vllm", "one backend (xgrammar)", "outlines", _NO),
    ("guided_whitespace_pattern", REFD, "vllm", "the grammar's whitespace rule is fixed", " *", _NO),
    ("structural_tag", REFD, "vllm", "no structural tags", "{}", _NO),
    ("repetition_detection", REFD, "vllm", "no repetition detection", {"n": 4}, _NO),
    ("thinking_token_budget", REFD, "vllm", "no thinking budget", 16, (None, -1)),
    ("kv_transfer_params", REFD, "vllm", "no disaggregated serving", {"a": 1}, _NO),
    ("vllm_xargs", REFD, "vllm", "no custom extensions", {"a": 1}, _NO),
    ("mm_processor_kwargs", REFD, "vllm", "text models only", {"a": 1}, _NO),
    ("priority", HARM, "vllm", "scheduling order only (X-Session-Priority hints are /v1/hints')", 1, (None,)),
    ("request_id", HARM, "vllm", "the server names its responses", "req-1", (None,)),
]
_CHAT = [
    ("messages", IMPL, "openai", "text content parts; tool turns", None, (None,)),
    ("max_completion_tokens", IMPL, "openai", "as max_tokens", 3, (None,)),
    ("logprobs", IMPL, "openai", "per-token log-probabilities, streamed too", True, (None, False)),
    ("top_logprobs", IMPL, "openai", "0-20 alternatives, with logprobs", 2, (None,)),
    ("tools", IMPL, "openai", "function tools (docs/agents.md)", None, (None,)),
    ("tool_choice", IMPL, "openai", "auto, none, required or a named function", None, (None,)),
    ("parallel_tool_calls", IMPL, "openai", "false: one call at most", False, (None,)),
    ("response_format", IMPL, "openai", "text, json_object, json_schema (structured.py)",
     {"type": "json_object"}, (None,)),
    ("chat_template_kwargs", IMPL, "vllm", "template variables (e.g. enable_thinking)", {"x": 1}, (None,)),
    ("functions", REFD, "openai", "deprecated: use tools", [{"name": "f"}], _NO),
    ("function_call", REFD, "openai", "deprecated: use tool_choice", "auto", (None, "none")),
    ("audio", REFD, "openai", "text models only", {"voice": "alloy", "format": "wav"}, _NO),
    ("modalities", REFD, "openai", "text output only", ["text", "audio"], (None, ["text"])),
    ("reasoning_effort", REFD, "openai", "no effort control (Qwen3: chat_template_kwargs enable_thinking)", "low",
     (None,)),
    ("verbosity", REFD, "openai", "no verbosity control", "low", (None,)),
    ("web_search_options", REFD, "openai", "no web search", {}, (None,)),
    ("prediction", HARM, "openai", "predicted outputs only speed OpenAI up; the answer is the same",
     {"type": "content", "content": "x"}, (None,)),
    ("store", HARM, "openai", "OpenAI's distillation store; no effect", True, (None,)),
    ("metadata", HARM, "openai", "no effect", {"k": "v"}, (None,)),
    ("service_tier", HARM, "openai", "one tier", "default", (None,)),
    ("safety_identifier", HARM, "openai", "no effect", "u-1", (None,)),
    ("prompt_cache_key", HARM, "openai", "reuse is automatic (sessions, prefix sharing)", "k", (None,)),
    ("echo", REFD, "vllm", "the last message is not prepended", True, _NO),
    ("add_generation_prompt", REFD, "vllm", "always added", False, (None, True)),
    ("continue_final_message", REFD, "vllm", "no prefill of the final message", True, _NO),
    ("add_special_tokens", REFD, "vllm", "the chat template writes the special tokens", True, _NO),
    ("documents", REFD, "vllm", "no RAG documents", [{"title": "t", "text": "x"}], _NO),
    ("chat_template", REFD, "vllm", "the server's template (--chat-template)", "{{ messages }}", _NO),
    ("include_reasoning", REFD, "vllm", "reasoning_content is always returned", False, (None, True)),
]
_COMPLETIONS = [
    ("prompt", IMPL, "openai", "a string or token ids, or a list of up to 128: one choice each (no session)", None,
     (None,)),
    ("echo", IMPL, "openai", "the prompt's text before the completion's (not with logprobs: a 400)", True,
     (None, False)),
    ("logprobs", IMPL, "openai", "0-20: the legacy shape, with that many alternatives; streamed too", 1,
     (None,)),
    ("suffix", REFD, "openai", "no insertion", "x", _NO),
    ("response_format", REFD, "vllm", "constrained decoding on chat only", {"type": "json_object"},
     (None, {"type": "text"})),
    ("tools", REFD, "openai", "chat only", [{"type": "function", "function": {"name": "f"}}], _NO),
    ("tool_choice", REFD, "openai", "chat only", "auto", (None, "none")),
    ("functions", REFD, "openai", "chat only", [{"name": "f"}], _NO),
    ("function_call", REFD, "openai", "chat only", "auto", (None, "none")),
    ("prompt_embeds", REFD, "vllm", "token prompts only", "AAAA", _NO),
    ("add_special_tokens", REFD, "vllm", "the prompt is tokenized as is (no BOS added)", True, _NO),
]
_RESPONSES = [
    ("model", IMPL, "openai", "must name the served model (404 otherwise)", "another-model", (None,)),
    ("input", IMPL, "openai", "text or items (messages, function calls and outputs)", None, (None,)),
    ("instructions", IMPL, "openai", "a system message, not carried over", "Be brief.", (None,)),
    ("previous_response_id", IMPL, "openai", "continue a stored response (its session's KV)", None, (None,)),
    ("store", IMPL, "openai", "false: not stored, cannot be continued", False, (None,)),
    ("truncation", IMPL, "openai", "auto: the oldest items go when the context is full", "auto", (None,)),
    ("tools", IMPL, "openai", "function tools", None, (None,)),
    ("tool_choice", IMPL, "openai", "auto, none, required or a named function", None, (None,)),
    ("parallel_tool_calls", IMPL, "openai", "false: one call at most", False, (None,)),
    ("max_output_tokens", IMPL, "openai", "the most tokens generated", 3, (None,)),
    ("temperature", IMPL, "openai", "0-2", 1.5, (None,)),
    ("top_p", IMPL, "openai", "(0, 1]", 0.05, (None,)),
    ("stream", IMPL, "openai", "server-sent events", True, (None, False)),
    ("text", IMPL, "openai", "format text only (another format: a 400 naming text.format)", None, (None,)),
    ("metadata", HARM, "openai", "echoed back; no effect", {"k": "v"}, (None,)),
    ("user", HARM, "openai", "no effect", "alice", (None,)),
    ("service_tier", HARM, "openai", "one tier", "default", (None,)),
    ("safety_identifier", HARM, "openai", "no effect", "u-1", (None,)),
    ("prompt_cache_key", HARM, "openai", "reuse is automatic", "k", (None,)),
    ("stream_options", HARM, "openai", "include_obfuscation: no effect", {"include_obfuscation": False}, (None,)),
    ("background", IMPL, "openai", "queued / in_progress / completed, polled with GET; POST .../cancel", True,
     (None, False)),
    ("conversation", REFD, "openai", "no conversations API", "conv_1", _NO),
    ("prompt", REFD, "openai", "no prompt templates", {"id": "p"}, _NO),
    ("include", IMPL, "openai", "message.output_text.logprobs (plain-text replies, streamed too); other "
     "values: a 400", ["message.output_text.logprobs"], (None,)),
    ("top_logprobs", IMPL, "openai", "0-20 alternatives per token, with the logprobs include", 2, (None,)),
    ("reasoning", REFD, "openai", "no effort control", {"effort": "low"}, (None, {}, {"effort": None})),
    ("max_tool_calls", REFD, "openai", "no limit on calls", 1, (None,)),
    ("top_k", IMPL, "vllm", "0: off", 1, (None,)),
    ("seed", IMPL, "vllm", "as chat's", 7, (None,)),
    ("session_id", IMPL, "stateful-hf", "the session (as chat's)", "walk-2", (None, "")),
    ("cache_salt", IMPL, "vllm", "scopes prefix sharing", "salt-1", (None,)),
    ("priority", HARM, "vllm", "scheduling order only", 1, (None,)),
    ("request_id", HARM, "vllm", "the server names its responses", "req-1", (None,)),
    ("mm_processor_kwargs", REFD, "vllm", "text models only", {"a": 1}, _NO),
]


def _specs(endpoint: Endpoint, rows: list) -> list[FieldSpec]:
    return [FieldSpec(n, endpoint, s, o, note, ex, inert) for n, s, o, note, ex, inert in rows]


FIELDS: tuple[FieldSpec, ...] = tuple(
    _specs(CHAT, _SAMPLING + _CHAT)
    + _specs(COMPLETIONS, [r for r in _SAMPLING if r[0] not in {c[0] for c in _COMPLETIONS}] + _COMPLETIONS)
    + _specs(RESPONSES, _RESPONSES))

# the request model each endpoint parses (app.py's `_parse`): its class name -> endpoint
MODELS = {"ChatCompletionRequest": CHAT, "CompletionRequest": COMPLETIONS, "ResponsesRequest": RESPONSES}


def fields_of(endpoint: Endpoint) -> dict[str, FieldSpec]:
    return {f.name: f for f in FIELDS if f.endpoint is endpoint}


_BY_ENDPOINT = {e: fields_of(e) for e in Endpoint}
_warned: set[tuple[Endpoint, str]] = set()
_warned_lock = threading.Lock()


def asks_for(spec: FieldSpec, value) -> bool:
    """Whether `value` asks for something (is not one of the field's inert values)."""
    return not any(type(value) is type(v) and value == v for v in spec.inert)


def check(model_name: str, body: dict, strict: bool = False) -> None:
    """Check a request's raw JSON object against the list of its endpoint (`model_name`: the request
    model's class name; other models are not checked): a REFUSED field that asks for something is a 400
    naming it; an unknown field is a 400 naming it when `strict`, else dropped with a warning (once per
    field name)."""
    endpoint = MODELS.get(model_name)
    if endpoint is None:
        return
    known = _BY_ENDPOINT[endpoint]
    for name, value in body.items():
        spec = known.get(name)
        if spec is None:
            if strict:
                raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                               code="unknown_parameter")
            _warn_once(endpoint, name)
        elif spec.status is FieldStatus.REFUSED and asks_for(spec, value):
            raise APIError(400, f"`{name}` is not supported by this server ({spec.note}); remove it from the "
                           "request", param=name, code="unsupported_parameter")


def _warn_once(endpoint: Endpoint, name: str) -> None:
    with _warned_lock:
        if (endpoint, name) in _warned:
            return
        _warned.add((endpoint, name))
    log.warning("%s: the request field %r is not one this server knows; it is ignored (--strict-fields makes it a "
                "400)", endpoint.value, name[:80])


def table() -> str:
    """docs/server-api.md's field table (tests/test_serve_fields.py checks the docs hold it verbatim)."""
    rows = ["| endpoint | field | status | origin | here |", "|---|---|---|---|---|"]
    for f in FIELDS:
        note = f.note.replace("|", "/")
        rows.append(f"| `{f.endpoint.value}` | `{f.name}` | {f.status.value} | {f.origin} | {note} |")
    return "\n".join(rows)
