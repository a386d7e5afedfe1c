"""One tool call's arguments streamed as the model writes them (`tool_parse.ReplyParser` feeds it the
raw text of a `<tool_call>` region: `{"name": "f", "arguments": {...}}`).

Once the region's head is read (the name, then `"arguments": {`), the call starts: its name is known and
its arguments stream as canonical JSON text (`json.dumps`' separators, `ensure_ascii=False`), each token
written as soon as it is whole and a string value character by character, so every delta extends the
last and they reassemble to the call's arguments. Top-level members that transformers' parser coerces
to the tool's schema types (a string or array for a parameter typed otherwise) are written once whole,
coerced as the parser does. A region of another shape (another key order, `parameters`, arguments that
are not an object) does not stream: the parser's value at its close is the call, whole, as before.
Arguments that turn invalid or are cut (`max_tokens`) after the call started end with the model's raw
text from the first token that was not whole: nothing written is dropped (OpenAI's `arguments` are the
model's text). A string value shows only the part whose raw text is already canonical, so what was
streamed is a prefix of that ending, whatever the chunks. The non-streaming reply reads the same way, so
both give the same calls.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from json.decoder import JSONDecodeError, scanstring
from json.scanner import NUMBER_RE

import regex
from transformers.utils.chat_parsing import parse_response

from .tools import CALL_CLOSE, CALL_OPEN, CHATML_RESPONSE

_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*\{', regex.DOTALL)
_WS = " \t\n\r"
_WORD = frozenset("0123456789+-.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_CONSTANTS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")      # what json.loads accepts
# an unterminated string's body: whole escapes, then what may still grow (a high surrogate, a cut escape)
_PARTIAL = regex.compile(r'((?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*?)'
                         r'((?:\\u[dD][89abAB][0-9a-fA-F]{2})?(?:\\u[0-9a-fA-F]{0,3}|\\)?)')


class _Bad(Exception):
    """The text stops being JSON at this position."""


class ArgumentsReader:
    """An arguments object read from a growing text (`text[start]` is its `{`): `text` its canonical
    JSON as far as it is whole, `tail` the canonical opening of a string value being written.
    `properties`: the tool's parameter schemas; `coerce(key, value)`: a member's value as transformers'
    parser makes it."""

    def __init__(self, start: int, properties: dict, coerce: Callable[[str, object], object]):
        self.properties, self.coerce = properties, coerce
        self.at = start                 # text[:at] is read; the next token starts there
        self.stack: list[str] = []      # open containers, innermost last: "{" or "["
        self.expect = "value"           # value | value_or_close | key | key_or_close | colon | comma_or_close
        self.key = ""                   # the current top-level member's name
        self.held: int | None = None    # the start of a member value read quietly, written coerced
        self.text = ""
        self.tail = ""                  # the opening of the string at `at`: its raw text, equal to canonical
        self.done = False

    def stable(self) -> str:
        """What can no longer change: the complete tokens, then a string value's opening."""
        return self.text + self.tail

    def ending(self, text: str) -> str:
        """The arguments' text if `text` ends here: canonical when whole, else the complete tokens'
        canonical text, then the raw text from the first token that was not whole (a held member's)."""
        return self.text if self.done else self.text + text[self.at if self.held is None else self.held:].rstrip()

    def read(self, text: str) -> None:
        """Read `text[self.at:]` as far as its tokens are whole (a number or constant at the end may
        still grow; an object ends with its brace). Raises _Bad where it stops being JSON."""
        n = len(text)
        while not self.done:
            i = self.at
            while i < n and text[i] in _WS:
                i += 1
            self.at, self.tail = i, ""
            if i == n:
                return
            c, e = text[i], self.expect
            if e == "colon":
                self._need(c == ":", i)
                self._step(": ", i + 1, "value")
            elif e == "comma_or_close":
                if c == ",":
                    self._step(", ", i + 1, "key" if self.stack[-1] == "{" else "value")
                else:
                    self._need(c == ("}" if self.stack[-1] == "{" else "]"), i)
                    self._close(text, i)
            elif e == "key_or_close" and c == "}" or e == "value_or_close" and c == "]":
                self._close(text, i)
            elif e in ("key", "key_or_close"):
                self._need(c == '"', i)
                got = self._string(text, i, shown=False)
                if got is None:
                    return
                if len(self.stack) == 1:
                    self.key = got[0]
                self._step(json.dumps(got[0], ensure_ascii=False), got[1], "colon")
            elif not self._value(text, i):
                return

    def _value(self, text: str, i: int) -> bool:
        c = text[i]
        if len(self.stack) == 1 and c in '"[' and self.key in self.properties:
            schema = self.properties[self.key]      # only a plain string or array parameter streams
            plain = isinstance(schema, dict) and not {"anyOf", "oneOf", "nullable"} & schema.keys()
            if not plain or schema.get("type") != ("string" if c == '"' else "array"):
                self.held = i
        if c in "{[":
            self.stack.append(c)
            self._step(c, i + 1, "key_or_close" if c == "{" else "value_or_close")
            return True
        if c == '"':
            got = self._string(text, i, shown=self.held is None)
            if got is None:
                return False
            self._step(json.dumps(got[0], ensure_ascii=False), got[1], "comma_or_close")
        else:
            j = i
            while j < len(text) and text[j] in _WORD:
                j += 1
            if j == len(text):
                return False
            word = text[i:j]
            self._need(word in _CONSTANTS or NUMBER_RE.fullmatch(word) is not None, i)
            self._step(json.dumps(json.loads(word)), j, "comma_or_close")
        self._ended(text)
        return True

    def _close(self, text: str, i: int) -> None:
        self._step(text[i], i + 1, "comma_or_close")
        self.stack.pop()
        self._ended(text)

    def _ended(self, text: str) -> None:
        """A value ended at self.at: the whole object, or a held member (written now, coerced)."""
        if not self.stack:
            self.done = True
        elif len(self.stack) == 1 and self.held is not None:
            start, self.held = self.held, None
            self.text += json.dumps(self.coerce(self.key, json.loads(text[start:self.at])), ensure_ascii=False)

    def _step(self, canonical: str, at: int, expect: str) -> None:
        if self.held is None:
            self.text += canonical
        self.at, self.expect = at, expect

    def _string(self, text: str, i: int, shown: bool) -> tuple[str, int] | None:
        """(value, end) of the string at text[i]; None while it is unterminated (its opening shown as
        `tail` when `shown`)."""
        try:
            return scanstring(text, i + 1, True)
        except JSONDecodeError:
            m = _PARTIAL.fullmatch(text, i + 1)
            self._need(m is not None, i)
            try:
                body = scanstring('"' + m.group(1) + '"', 1, True)[0]
            except JSONDecodeError:
                raise _Bad(i) from None
            if shown:       # the longest opening that is both raw text and canonical: it only grows
                raw, canonical = text[i:i + 1 + len(m.group(1))], json.dumps(body, ensure_ascii=False)[:-1]
                n = next((k for k, (a, b) in enumerate(zip(raw, canonical)) if a != b), min(len(raw), len(canonical)))
                self.tail = raw[:n]
            return None

    @staticmethod
    def _need(ok: bool, i: int) -> None:
        if not ok:
            raise _Bad(i)


class CallStream:
    """One `<tool_call>` region's text as it arrives. `tools`: the request's tools by name (their
    schemas coerce values as transformers' parser does). After `feed`: `name` once the call started
    (None before, and always when the region does not stream); `take()` the arguments' new text;
    `finish()` at the region's close: the rest of the arguments (None: the region did not stream; the
    parser's value is the call)."""

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools
        self.body = ""
        self.name: str | None = None
        self.streams = True             # False once the region's head cannot be read
        self.args: ArgumentsReader | None = None
        self.sent = ""                  # the arguments' text handed out so far
        self.broken = False             # the arguments stopped being JSON: nothing more streams

    def feed(self, text: str) -> None:
        self.body += text
        if self.args is None and self.streams:
            m = _HEAD.match(self.body, partial=True)
            if m is None or not m.partial and not self._start(m):
                self.streams = False
        if self.args is not None and not self.broken:
            try:
                self.args.read(self.body)
            except _Bad:
                self.broken = True

    def take(self) -> str:
        """The arguments' text written since the last take (always an extension of what was sent)."""
        if self.args is None or self.broken:
            return ""
        stable = self.args.stable()
        assert stable.startswith(self.sent), (stable, self.sent)
        delta, self.sent = stable[len(self.sent):], stable
        return delta

    def finish(self) -> str | None:
        """The arguments' last text at the region's close; None: the region did not stream."""
        if self.args is None:
            return None
        ending = self.args.ending(self.body)
        assert ending.startswith(self.sent), (ending, self.sent)
        rest, self.sent = ending[len(self.sent):], ending
        return rest

    def _start(self, m) -> bool:
        name = json.loads(m.group(1))
        if not isinstance(name, str) or not name:
            return False
        tool = self.tools.get(name)
        props = ((tool or {}).get("function", tool or {}).get("parameters") or {}).get("properties") or {}
        self.name = name
        self.args = ArgumentsReader(m.end() - 1, props if isinstance(props, dict) else {},
                                    lambda key, value: _coerced(tool, key, value))
        return True


@functools.cache
def _template() -> dict:
    return json.loads(CHATML_RESPONSE.read_text())


def _coerced(tool: dict, key: str, value):
    """`value` of the parameter `key` as transformers' parser makes it (cast to the tool's schema)."""
    call = json.dumps({"name": tool["function"]["name"], "arguments": {key: value}}, ensure_ascii=False)
    out = parse_response(f"{CALL_OPEN}{call}\n{CALL_CLOSE}", _template(), prefix="", tools=[tool])
    return out["tool_calls"][0]["function"]["arguments"][key]
