"""Conversations to serve: loaded from ShareGPT-format files or synthesized from published statistics.

A conversation is a list of turns; a turn is the user's new token ids and the number of tokens the
assistant answers with. The answer's *content* is whatever the served model generates (greedy, EOS
ignored), so every system does the same work: prompt of turn t = all earlier user ids and answers,
then turn t's user ids. Arrival times and think times are drawn here, once, with a seed, so every
system sees the same schedule.
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

# Pensieve §6 (DIGEST.md): mean turns per conversation, input and output tokens per turn.
DATASET_STATS = {
    "sharegpt": (5.56, 37.77, 204.58),
    "ultrachat": (3.86, 51.78, 257.81),
}
SAMPLE = Path(__file__).parent / "data" / "sample_sharegpt.json"   # a small ShareGPT-format sample
LOGNORMAL_SIGMA = 1.0          # spread of per-turn lengths (ShareGPT lengths are heavy-tailed)


@dataclass(frozen=True, slots=True)
class Turn:
    user_ids: tuple[int, ...]
    output_len: int
    think_s: float = 0.0       # the user's pause after this turn's answer, before sending the next


@dataclass(frozen=True, slots=True)
class Conversation:
    conv_id: str
    turns: tuple[Turn, ...]
    start_s: float = 0.0       # arrival of the first turn (open loop), relative to the run's start

    @property
    def max_context(self) -> int:
        return sum(len(t.user_ids) + t.output_len for t in self.turns)


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: tuple[Conversation, ...]
    source: str
    notes: dict = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_len for c in self.conversations for t in c.turns)

    def describe(self) -> dict:
        turns = [t for c in self.conversations for t in c.turns]
        return {"source": self.source, "conversations": len(self.conversations), "turns": len(turns),
                "mean_turns": len(turns) / max(len(self.conversations), 1),
                "mean_input_tokens": sum(len(t.user_ids) for t in turns) / max(len(turns), 1),
                "mean_output_tokens": sum(t.output_len for t in turns) / max(len(turns), 1),
                "max_context_tokens": max((c.max_context for c in self.conversations), default=0), **self.notes}


def _lognormal_int(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    mu = math.log(max(mean, 1e-3)) - LOGNORMAL_SIGMA ** 2 / 2      # E[X] = mean before clipping
    return int(min(max(round(rng.lognormvariate(mu, LOGNORMAL_SIGMA)), lo), hi))


def _geometric(rng: random.Random, mean: float, hi: int) -> int:
    """Turns >= 1 with the given mean (geometric: a conversation ends after each turn w.p. 1/mean)."""
    p, n = 1.0 / max(mean, 1.0), 1
    while n < hi and rng.random() > p:
        n += 1
    return n


def synthesize(n: int, dataset: str = "sharegpt", scale: float = 1.0, max_turns: int = 16, max_input: int = 1024,
               max_output: int = 1024, vocab: int = 32000, seed: int = 0,
               text_ids: tuple[int, ...] = ()) -> Workload:
    """`n` conversations with the dataset's mean turns and per-turn lengths (lengths multiplied by
    `scale`): turns geometric, lengths log-normal (sigma 1), clipped to the maxima. A turn's ids are
    random in [3, vocab), or with `text_ids` (a tokenized text) a window of that text at a random
    offset: real text at the published lengths, for a model with real weights."""
    turns_mean, in_mean, out_mean = DATASET_STATS[dataset]
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        turns = []
        for _ in range(_geometric(rng, turns_mean, max_turns)):
            k = _lognormal_int(rng, in_mean * scale, 1, max_input)
            if text_ids:
                start = rng.randrange(len(text_ids))
                ids = tuple((text_ids[start:] + text_ids * (1 + k // len(text_ids)))[:k])
            else:
                ids = tuple(rng.randrange(3, vocab) for _ in range(k))
            turns.append(Turn(ids, _lognormal_int(rng, out_mean * scale, 1, max_output)))
        convs.append(Conversation(f"c{i}", tuple(turns)))
    return Workload(tuple(convs), f"synthetic-{dataset}" + ("-text" if text_ids else ""),
                    {"scale": scale, "paper_means": dict(zip(("turns", "input", "output"), DATASET_STATS[dataset]))})


def with_system_prompt(wl: Workload, n: int, vocab: int, seed: int = 0, text: tuple[int, ...] = ()) -> Workload:
    """Every conversation of `wl` opening with the same `n` tokens (a system prompt): random ids in
    [3, vocab) from `seed`, or the first `n` of `text` (a tokenized text, for a model with real
    weights), prepended to each conversation's first turn."""
    if n < 0:
        raise ValueError(f"system prompt of {n} tokens")
    if n == 0:
        return wl
    if text:
        prompt = tuple((text * (1 + n // len(text)))[:n])
    else:
        rng = random.Random(f"system-prompt-{seed}")
        prompt = tuple(rng.randrange(3, vocab) for _ in range(n))
    convs = tuple(Conversation(c.conv_id, (Turn(prompt + c.turns[0].user_ids, c.turns[0].output_len,
                                                c.turns[0].think_s), *c.turns[1:]), c.start_s)
                  for c in wl.conversations)
    return Workload(convs, wl.source, {**wl.notes, "system_prompt_tokens": n})


def text_ids(tokenizer, path: str | Path = SAMPLE) -> tuple[int, ...]:
    """Every message of a ShareGPT-format JSON file (default: the bundled sample), in order, tokenized
    with the model's tokenizer: the text `synthesize(text_ids=...)` cuts its turns from."""
    records = json.loads(Path(path).read_text())
    text = "\n".join(m["value"] for r in records for m in r.get("conversations") or r.get("items") or [])
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


_WORD = re.compile(r"\w+|[^\w\s]")


def hash_tokenize(text: str, vocab: int) -> list[int]:
    """Offline stand-in for a tokenizer: words and punctuation marks, each mapped to a stable id in
    [3, vocab) (crc32). Counts come close to BPE counts on English text; the ids carry no meaning to a
    model with random weights anyway. Pass a real tokenizer to `load_sharegpt` to use its ids."""
    return [3 + zlib.crc32(w.encode()) % (vocab - 3) for w in _WORD.findall(text)]


def load_sharegpt(path: str, limit: int | None = None, scale: float = 1.0, max_turns: int = 16,
                  max_input: int = 1024, max_output: int = 1024, vocab: int = 32000, tokenizer=None) -> Workload:
    """ShareGPT-format JSON or JSONL (records with `conversations: [{from, value}, ...]`), read with
    `datasets` from the local file (offline). Each human message is a turn's user ids; the next gpt
    message's token count (times `scale`) is the turn's output length. Conversations that do not
    start with a human message have their leading non-human messages skipped."""
    import datasets

    ds = datasets.load_dataset("json", data_files=path, split="train")
    encode = (lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]) if tokenizer is not None \
        else (lambda s: hash_tokenize(s, vocab))
    convs = []
    for rec in ds:
        msgs = rec.get("conversations") or rec.get("items") or []
        turns, i = [], 0
        while i < len(msgs) and len(turns) < max_turns:
            if msgs[i].get("from") not in ("human", "user") or i + 1 >= len(msgs):
                i += 1
                continue
            user = encode(msgs[i]["value"])[:max_input]
            out = max(1, min(round(len(encode(msgs[i + 1]["value"])) * scale), max_output))
            if user:
                turns.append(Turn(tuple(user[:max(1, round(len(user) * scale))]), out))
            i += 2
        if turns:
            convs.append(Conversation(str(rec.get("id", len(convs))), tuple(turns)))
        if limit is not None and len(convs) >= limit:
            break
    return Workload(tuple(convs), f"sharegpt-file:{path}", {"scale": scale})
