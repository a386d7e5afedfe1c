"""Incremental detokenization of one request's output, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence


class OutputText:
    """Decodes the generated ids after each new token.

    `text` is the decoded output, cut before the first stop string once one appears. `stable` is how
    much of it can be streamed now: a trailing replacement char (an incomplete UTF-8 sequence) and the
    last len(longest stop) - 1 chars (a stop string may still be forming) are held back until the end.
    `ends[i]`: the decoded length of the first i + 1 ids (before any stop cut): where token i's text ends,
    so a stream sends token i's log-probability with the chunk whose stable text reaches `ends[i]`.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: Engine(model, tokenizer=...)")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.stable = 0
        self.ends: list[int] = []              # one per id decoded: chars of the uncut text through it
        self._hold = max(map(len, self.stop), default=1) - 1

    def update(self, token_ids: Sequence[int]) -> bool:
        """Re-decode `token_ids` (all generated so far). Returns True when a stop string appeared."""
        if self.tokenizer is None:
            return False
        prev = len(self.text)
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)
        del self.ends[len(token_ids) - 1:]
        self.ends.append(len(text))
        if self.stop:
            start = max(prev - self._hold, 0)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = text[:min(hits)]
                self.stable = len(self.text)
                return True
        self.text = text
        end = len(text) - self._hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        self.stable = max(end, 0)
        return False

    def finish(self) -> None:
        self.stable = len(self.text)
