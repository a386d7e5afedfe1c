"""Structured output over HTTP: a chat request's `response_format` as its `SamplingParams.constraint`.

OpenAI's shapes: `{"type": "text"}` (free), `{"type": "json_object"}` (any JSON object) and
`{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`. The constraint
is checked before the turn is queued (`constrain`, called by the app's `chat_turn` in the request's
worker thread, never on the event loop): the grammar is compiled, with the server's time limit, into
the cache the engine then finds it in, so an invalid schema, or one that compiles too slowly, is a 400
naming the field (the engine's own failure, `GrammarError`, says why). Imported only by a request that
asks for a format. A caller that constrains a request for another field (tool calls: `tool_choice`)
uses `check_constraint` with its own `param`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from ..engine import SamplingParams
from ..engine.constraint import JsonConstraint, json_constraint
from .protocol import APIError

if TYPE_CHECKING:
    from .tools import ToolPlan

FORMATS = ("text", "json_object", "json_schema")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")            # OpenAI's rule for json_schema.name
PARAM = "response_format"


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"response_format: {message}", param=PARAM, code=code)


def response_format_constraint(value) -> JsonConstraint | None:
    """The constraint a `response_format` asks for (None: free text); a 400 naming response_format for
    a malformed one (its schema is checked by `check_constraint`)."""
    if value is None:
        return None
    if not isinstance(value, dict) or "type" not in value:
        raise _bad(f"must be an object with a `type` ({', '.join(FORMATS)}), got {_short(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_constraint("json_object")
    if kind != "json_schema":
        raise _bad(f"type must be one of {', '.join(FORMATS)}, got {_short(kind)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("a json_schema format needs `json_schema`: an object with `name` and `schema`")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(f"json_schema.name must be 1-64 letters, digits, '_' or '-', got {_short(name)}")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"json_schema.strict must be a boolean, got {_short(strict)}")
    if schema is None:                          # OpenAI's schema is optional: then any JSON object
        return json_constraint("json_object", name=name)
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"json_schema.schema must be a JSON schema (an object), got {type(schema).__name__}",
                   "invalid_schema")
    try:
        return json_constraint(schema, strict=bool(strict), name=name)
    except ValueError as e:
        raise _bad(f"json_schema.schema: {e}", "invalid_schema") from None


def constrain(sampling: SamplingParams, response_format, tokenizer, timeout: float | None,
              plan: ToolPlan | None = None) -> SamplingParams:
    """`sampling` constrained as `response_format` asks (as it is for None or text), or, for a forced tool
    call (`plan`: a `tools.ToolPlan` with `forced`), to the rest of that call: the function's JSON schema,
    then the call's closing text. Its grammar compiled here (a 400 naming the field that says why)."""
    forced = None if plan is None else plan.forced
    if forced is not None:
        if response_format_constraint(response_format) is not None:
            raise APIError(400, "response_format cannot be combined with a forced tool call (tool_choice "
                           "'required' or a named function): the call's arguments follow the function's schema",
                           param="response_format", code="invalid_value")
        constraint = json_constraint(forced[0], strict=True, suffix=forced[1])
        check_constraint(constraint, tokenizer, timeout, param="tool_choice")
        return dataclasses.replace(sampling, constraint=constraint)
    constraint = response_format_constraint(response_format)
    if constraint is None:
        return sampling
    check_constraint(constraint, tokenizer, timeout)
    return dataclasses.replace(sampling, constraint=constraint)


def check_constraint(constraint: JsonConstraint, tokenizer, timeout: float | None, param: str = PARAM) -> None:
    """Compile `constraint` now (cached for the engine); a 400 naming `param` that says why it cannot be
    used: an invalid or unsupported schema, a compile over `timeout` seconds, no grammar library."""
    from ..engine.grammar import COMPILERS, GrammarError
    try:
        COMPILERS.compile(tokenizer, constraint, timeout, param)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=e.param, code=e.code) from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
