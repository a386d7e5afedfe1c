"""What a constrained request asks for: `JsonConstraint`, the value of `SamplingParams.constraint`.

Plain data (no torch, no grammar library): a request's constraint crosses process boundaries with its
SamplingParams, and the grammar is compiled where the request runs (`grammar.py`, imported only by a
request that carries one). `json_constraint` turns what callers write into one:

- `"json_object"`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
- a JSON schema as a dict or JSON text, or a pydantic model class: JSON that validates against it;
- a `JsonConstraint`, as is (with `prefix` / `suffix`: literal text around the JSON, for a tool call's tags).

The schema's canonical text is `json.dumps` without spaces, keys in the schema's own order: property
order is meaningful (the grammar emits properties in the order the schema declares them), so two
schemas that differ only in it are two grammars.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

JSON_OBJECT = "json_object"


@dataclass(frozen=True, slots=True)
class JsonConstraint:
    """Decode only JSON: any JSON object (`schema` None) or JSON matching `schema`. `strict`: properties
    and items the schema does not name are refused (OpenAI's strict structured outputs); False lets an
    object carry other properties where the schema does not forbid them. `prefix` / `suffix`: literal
    text the output has before / after the JSON (a model's tool-call tags, `<tool_call>` ... `</tool_call>`)."""

    schema: str | None = None          # canonical JSON text of the schema; None: any JSON object
    strict: bool = True
    name: str | None = None            # the schema's name (OpenAI's json_schema.name), for messages only
    prefix: str = ""
    suffix: str = ""

    @property
    def key(self) -> str:
        """What identifies the grammar (with the tokenizer): the grammar cache's key."""
        what = "object" if self.schema is None else f"schema:{self.schema}"
        around = f"{json.dumps(self.prefix)}:{json.dumps(self.suffix)}:" if self.prefix or self.suffix else ""
        return f"{around}{self.strict}:{what}"

    def describe(self) -> str:
        if self.schema is None:
            return "a JSON object"
        return f"JSON schema {self.name!r}" if self.name else "the JSON schema"


def canonical(schema) -> str:
    """The canonical text of a schema (a dict, a bool, or JSON text); ValueError if it is not JSON."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the schema is not JSON: {e}") from None


def json_constraint(value, *, strict: bool = True, name: str | None = None, prefix: str = "",
                    suffix: str = "") -> JsonConstraint:
    """A `JsonConstraint` from "json_object", a schema (dict, JSON text or pydantic model class) or a
    JsonConstraint. ValueError for anything else (the schema itself is checked when it is compiled)."""
    if isinstance(value, JsonConstraint):
        return value
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise ValueError("prefix and suffix are literal text (str)")
    if value == JSON_OBJECT:
        return JsonConstraint(None, strict=False, name=name, prefix=prefix, suffix=suffix)
    schema_of = getattr(value, "model_json_schema", None)       # a pydantic model class
    if isinstance(value, type) and callable(schema_of):
        return JsonConstraint(canonical(schema_of()), strict, name or value.__name__, prefix, suffix)
    if isinstance(value, (dict, str, bytes, bool)):
        return JsonConstraint(canonical(value), strict, name, prefix, suffix)
    raise ValueError(f"constraint must be 'json_object', a JSON schema (dict or JSON text), a pydantic model "
                     f"class or a JsonConstraint, got {type(value).__name__}")
