"""A request body, from its bytes to a request model: `parse` (in a worker thread, app.py).

Checked before the model sees it, each refusal a 400 in OpenAI's shape:
- nesting: at most `MAX_DEPTH` levels of arrays and objects, counted on the bytes before the JSON is
  parsed (`depth`: a parse of a 100,000-deep body would exhaust the interpreter's recursion); `body`;
- JSON: `body` names a body that is not a JSON object;
- text: a lone UTF-16 surrogate (`"a\\ud800b"`: no character, it cannot be tokenized or written back as
  UTF-8) anywhere in the body, key or value, is refused, `param` naming where (`messages.0.content`);
- numbers: `Infinity`, `-Infinity` and `NaN` (accepted by Python's parser, not JSON) likewise;
- the model's own validation: `param` is the path of the first error in the body as sent
  (pydantic's union tags such as `str` or `list[...]` left out), preferring the deepest.
"""

from __future__ import annotations

import json
import math
import re

from pydantic import ValidationError

from .fields import check as check_fields
from .protocol import APIError

MAX_DEPTH = 64                 # arrays and objects, the body itself included
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')            # a JSON string, escapes included
_OPENERS = (b"[", b"{")
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")       # -> +1 / -1 (int8), the rest:
_KEEP = bytes(range(256)).translate(None, b"[{]}")             # deleted
# what may hold a lone surrogate or a non-finite number: a \uD800-\uDFFF escape, a UTF-8-encoded
# surrogate (Python's parser decodes bytes with surrogatepass), the names Infinity and NaN
_SUSPECT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|Infinity|NaN")
_SURROGATE = re.compile("[\ud800-\udfff]")


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (JSON text, strings skipped). Linear in its
    length at C speed; a body with at most MAX_DEPTH brackets is not scanned."""
    if sum(raw.count(b) for b in _OPENERS) <= MAX_DEPTH:
        return MAX_DEPTH
    import numpy as np
    brackets = _STRING.sub(b"", raw).translate(None, _KEEP).translate(_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(np.frombuffer(brackets, dtype=np.int8), dtype=np.int64).max())


def _refused(value, path: str) -> tuple[str, str] | None:
    """(path, what) of the first lone surrogate or non-finite number in a parsed body (depth bounded)."""
    if isinstance(value, str):
        return (path, "a lone UTF-16 surrogate (not a character)") if _SURROGATE.search(value) else None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"{value} (JSON numbers are finite)")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        at = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return at, "a key with a lone UTF-16 surrogate (not a character)"
        found = _refused(v, at)
        if found is not None:
            return found
    return None


def _param(err: dict, body) -> str:
    """The path of a pydantic error within the body as sent: the union and validator tags of its `loc`
    left out (only keys and indexes the body has), the name of a field the body lacks kept (a missing
    one, or a default a validator refused)."""
    parts, at, loc, taken = [], body, err["loc"], []
    for p in loc:
        taken.append(isinstance(at, dict) and isinstance(p, str) and p in at or (
            isinstance(at, list) and isinstance(p, int) and 0 <= p < len(at)))
        if taken[-1]:
            at = at[p]
            parts.append(str(p))
    lacking = loc and not taken[-1] and (len(loc) == 1 or taken[-2]) and isinstance(at, dict)
    if lacking and err["type"] in ("missing", "value_error"):
        parts.append(str(loc[-1]))
    return ".".join(parts) or "body"


def parse(raw: bytes, model_cls, strict_fields: bool = False):
    """The request body as `model_cls`; a 400 naming the field otherwise (`body`: not a JSON object,
    or nested deeper than MAX_DEPTH). Its fields are checked against fields.py's list first (`strict_fields`:
    an unknown one is a 400, else dropped with a warning)."""
    if depth(raw) > MAX_DEPTH:
        raise APIError(400, f"the JSON body nests arrays and objects deeper than {MAX_DEPTH} levels", param="body",
                       code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", param="body",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param="body", code="invalid_json")
    check_fields(model_cls.__name__, body, strict_fields)
    if _SUSPECT.search(raw) or json.detect_encoding(raw) != "utf-8":
        found = _refused(body, "")
        if found is not None:
            raise APIError(400, f"{found[0]}: {found[1]}", param=found[0], code="invalid_value")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        err = max(errors, key=lambda x: len(x["loc"]))     # the deepest (first of those): the most specific
        param = _param(err, body)
        raise APIError(400, f"{param}: {err['msg'].removeprefix('Value error, ')}", param=param,
                       code="missing_required_parameter" if err["type"] == "missing" else "invalid_value") from None
