"""Sampling parameters of one request and the sampler that turns a step's logits into tokens.

`sample` processes a step's rows together, as tensors [R, V], in the order transformers' `generate`
applies its logits processors: `logit_bias` (its sequence_bias), `repetition_penalty` (over the whole
conversation, prompt and generated), `min_tokens` (EOS and stop ids masked, MinNewTokensLength), then
`presence_penalty` / `frequency_penalty` (OpenAI's, over the generated tokens, as vLLM); greedy rows take
the argmax there; sampled rows go on through temperature, top-k, top-p and min-p and draw from their own
generator (so a seeded request's tokens are the same alone and in any batch).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .constraint import JsonConstraint

MAX_LOGPROBS = 20          # OpenAI's bound on top_logprobs
MAX_PENALTY = 2.0          # OpenAI's bound on |presence_penalty| and |frequency_penalty|
MAX_LOGIT_BIAS = 100.0     # OpenAI's bound on |logit_bias| values


DEFAULT_MAX_NEW_TOKENS = 64      # SamplingParams.max_new_tokens's default

@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one turn is decoded.

    temperature 0 means greedy (argmax; top_p / top_k / min_p / seed are then unused). EOS ids come from
    the model's generation config and end the turn unless `ignore_eos`. `stop_token_ids` end it too (the
    stop token is kept in `token_ids`, as `generate` keeps EOS). `stop` strings need a tokenizer; the
    text is cut before the first occurrence. Penalties, `min_tokens` and `logit_bias` apply to greedy
    and sampled turns alike (module docstring: their order).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                           # 0 = no top-k filter
    seed: int | None = None                  # per-request torch.Generator when sampling
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True         # for the decoded text only
    # log-probabilities of the chosen tokens (the model's distribution: before penalties, biases,
    # temperature / top-p / top-k) with this many most likely alternatives each (0..20); None: not computed
    logprobs: int | None = None
    # structured output: decode only JSON, any object ("json_object") or matching a JSON schema (a dict,
    # JSON text or pydantic model class); made a `constraint.JsonConstraint` here. None: free decoding
    constraint: JsonConstraint | None = None
    # transformers' RepetitionPenaltyLogitsProcessor over the prompt and the generated tokens: a seen
    # token's logit is divided by it (multiplied when negative). > 0; 1 = off
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted once from the logit of each token generated so far (presence) and once per
    # time it was generated (frequency). [-2, 2]; 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' MinPLogitsWarper (sampling only): tokens under min_p x the top token's probability
    # are dropped. [0, 1]; 0 = off
    min_p: float = 0.0
    # EOS (unless ignore_eos) and stop_token_ids cannot be chosen before this many tokens. <= max_new_tokens
    min_tokens: int = 0
    # added to the logits of these token ids ((id, bias) pairs sorted by id; a mapping is accepted). Ids
    # beyond the model's vocabulary are not applied (the server refuses them)
    logit_bias: tuple[tuple[int, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.constraint is not None:         # only a constrained request imports constraint.py
            from .constraint import json_constraint
            object.__setattr__(self, "constraint", json_constraint(self.constraint))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not (_real(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf):
            raise ValueError("repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_real(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v!r}")
        if not (_real(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before the argmax (penalties, min_tokens, logit_bias)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.logit_bias))

    @classmethod
    def from_generation_config(cls, generation_config, **explicit) -> SamplingParams:
        """Defaults in one precedence: `explicit` fields (the caller's arguments or request fields;
        pass only those given), then the model's generation config (as vLLM's
        `--generation-config auto`), then this class's defaults. Greedy unless the generation config
        sets do_sample=True; then its temperature / top_p / top_k / min_p, with generate's global defaults
        (1.0 / 1.0 / 50 / off) for the ones it leaves unset. max_new_tokens from its max_new_tokens (its
        max_length counts the prompt, so it is not used); repetition_penalty and min_new_tokens (as
        min_tokens) from it too. Options the engine does not implement (no_repeat_ngram_size, ...) are
        named in a warning: with them the engine differs from generate."""
        unknown = set(explicit) - set(cls.__slots__)
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
        cfg, fields = generation_config, dict[str, Any]()
        if cfg is not None:
            if getattr(cfg, "max_new_tokens", None) is not None:
                fields["max_new_tokens"] = int(cfg.max_new_tokens)
            if getattr(cfg, "do_sample", None):
                fields["temperature"] = _or(cfg.temperature, 1.0)
                fields["top_p"] = _or(cfg.top_p, 1.0)
                fields["top_k"] = _or(cfg.top_k, 50)
                fields["min_p"] = _or(getattr(cfg, "min_p", None), 0.0)
            if getattr(cfg, "repetition_penalty", None) is not None:
                fields["repetition_penalty"] = float(cfg.repetition_penalty)
            if getattr(cfg, "min_new_tokens", None):
                fields["min_tokens"] = int(cfg.min_new_tokens)
            ignored = [f"{k}={getattr(cfg, k)!r}" for k, neutral in _UNSUPPORTED
                       if getattr(cfg, k, None) not in (None, neutral) and k not in explicit]
            if ignored:
                warnings.warn(f"the model's generation config sets {', '.join(ignored)}, which the engine does not "
                              "implement: its tokens can differ from generate's", stacklevel=2)
        fields.update(explicit)
        if "min_tokens" in fields and "min_tokens" not in explicit:     # the config's, within the turn's budget
            fields["min_tokens"] = min(fields["min_tokens"], fields.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        return cls(**fields)


def _or(value, default):
    return default if value is None else value


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (id, bias) pairs sorted by id, from a mapping or pairs; ValueError naming the field."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: dict[int, float] = {}
    try:
        for k, v in items:
            tid = int(k)
            if isinstance(k, (bool, float)) or tid < 0:
                raise ValueError
            if not (_real(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                raise ValueError
            out[tid] = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids (ints >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, "
                         f"{MAX_LOGIT_BIAS:g}], got {bias!r:.200}") from None
    return tuple(sorted(out.items()))


# generation config options that change which token is chosen, with their neutral values
_UNSUPPORTED = (("no_repeat_ngram_size", 0), ("min_length", 0), ("bad_words_ids", None), ("suppress_tokens", None),
                ("begin_suppress_tokens", None), ("forced_eos_token_id", None), ("num_beams", 1),
                ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0), ("sequence_bias", None))


def eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """EOS token ids as `generate` takes them: the model's generation config only (int, list or None).
    Not model.config.eos_token_id: generate does not stop there when the generation config has none."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


class _TokenTensors:
    """Token-id lists as int64 tensors, kept between steps: a list seen before (the same object, no
    shorter) is converted only past what was (a request's prompt once, its output one token per step).
    An entry holds its list, so its id is not reused while it is kept; entries unused for `max_idle`
    calls are dropped. Thread-safe (engines of one process share it)."""

    def __init__(self, max_idle: int = 64):
        self.max_idle = max_idle
        self._entries: dict[int, list] = {}          # id(list) -> [list, converted length, tensor, last call]
        self._calls = 0
        self._lock = threading.Lock()

    def get(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        with self._lock:
            e = self._entries.get(id(ids))
            if e is None or e[0] is not ids or len(ids) < e[1] or e[2].device != device:
                e = [ids, len(ids), torch.tensor(list(ids), dtype=torch.long, device=device), self._calls]
                self._entries[id(ids)] = e
            elif len(ids) > e[1]:
                e[2] = torch.cat([e[2], torch.tensor(list(ids[e[1]:]), dtype=torch.long, device=device)])
                e[1] = len(ids)
            e[3] = self._calls
            return e[2]

    def tick(self) -> None:
        """One sampler call done: drop the entries it and the `max_idle` calls before did not use."""
        with self._lock:
            self._calls += 1
            stale = [k for k, e in self._entries.items() if self._calls - e[3] > self.max_idle]
            for k in stale:
                del self._entries[k]


_TOKENS = _TokenTensors()


def _rows_tokens(rows: Sequence[int], lists: Sequence[Sequence[int]], vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of `lists[r]` for r in rows, numbered 0.. in `rows` order; ids
    outside [0, vocab) left out."""
    parts = [_TOKENS.get(lists[r], device) for r in rows]
    lengths = torch.tensor([len(p) for p in parts], device=device)
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
    row = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    keep = (ids >= 0) & (ids < vocab)
    return row[keep], ids[keep]


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def process(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]] | None = None,
            outputs: Sequence[Sequence[int]] | None = None, eos: frozenset[int] = frozenset()) -> torch.Tensor:
    """logits [R, V] -> float32 [R, V] with each row's logit_bias, repetition_penalty (over prompts[i] +
    outputs[i]), min_tokens mask (EOS unless ignore_eos, and stop_token_ids, while len(outputs[i]) <
    min_tokens) and presence / frequency penalties (over outputs[i]) applied, in that order. A row
    those leave without a finite logit is the input row (with what made it finite). `prompts` /
    `outputs` are needed only when a row has penalties or min_tokens."""
    x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    R, V = x.shape
    dev = x.device
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        pairs = [(j, t, b) for j, i in enumerate(biased) for t, b in params[i].logit_bias if t < V]
        if pairs:
            b_rows, b_ids, b_vals = zip(*pairs, strict=True)
            bias = torch.zeros(len(biased), V, dtype=torch.float32, device=dev)
            bias[torch.tensor(b_rows, device=dev), torch.tensor(b_ids, device=dev)] = torch.tensor(b_vals, device=dev)
            x[biased] = x[biased] + bias
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        if prompts is None or outputs is None:
            raise ValueError("process: repetition_penalty needs the rows' prompts and outputs")
        seen = torch.zeros(len(rep), V, dtype=torch.bool, device=dev)
        for lists in (prompts, outputs):
            r_rows, r_ids = _rows_tokens(rep, lists, V, dev)
            seen[r_rows, r_ids] = True
        pen = _column([params[i].repetition_penalty for i in rep], dev)
        sub = x[rep]
        x[rep] = torch.where(seen, torch.where(sub < 0, sub * pen, sub / pen), sub)
    early = [i for i, p in enumerate(params) if p.min_tokens > 0]
    if early:
        if outputs is None:
            raise ValueError("process: min_tokens needs the rows' outputs")
        stops = [(i, t) for i in early if len(outputs[i]) < params[i].min_tokens
                 for t in (set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else set(eos))) if 0 <= t < V]
        if stops:
            m_rows, m_ids = zip(*stops, strict=True)
            dead = sorted(set(m_rows))
            before = x[dead]
            x[torch.tensor(m_rows, device=dev), torch.tensor(m_ids, device=dev)] = -math.inf
            lost = ~torch.isfinite(x[dead].amax(-1))
            if bool(lost.any()):      # every allowed token was a stop (a grammar's end): stopping beats nothing
                x[dead] = torch.where(lost.unsqueeze(1), before, x[dead])
    counted = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if counted:
        if outputs is None:
            raise ValueError("process: presence_penalty / frequency_penalty need the rows' outputs")
        c_rows, c_ids = _rows_tokens(counted, outputs, V, dev)
        counts = torch.zeros(len(counted), V, dtype=torch.float32, device=dev)
        counts.index_put_((c_rows, c_ids), torch.ones_like(c_ids, dtype=torch.float32), accumulate=True)
        freq = _column([params[i].frequency_penalty for i in counted], dev)
        pres = _column([params[i].presence_penalty for i in counted], dev)
        x[counted] = x[counted] - freq * counts - pres * (counts > 0).float()
    return x


def warp(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Processed logits [R, V] of sampled rows -> the logits they are drawn from: divided by the
    temperature, then top-k, top-p and min-p filtered (dropped tokens -inf), as transformers' warpers."""
    dev = x.device
    x = x / _column([p.temperature for p in params], dev)
    k = [p.top_k for p in params]
    if any(k):
        V = x.shape[-1]
        kth = torch.tensor([min(v, V) - 1 if v else V - 1 for v in k], device=dev).unsqueeze(1)
        top = torch.sort(x, dim=-1, descending=True).values.gather(1, kth)
        x = x.masked_fill(x < top, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        ascending, order = torch.sort(x, dim=-1, descending=False)
        cum = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= _column([1 - p.top_p for p in params], dev)
        drop[..., -1:] = False
        x = x.masked_fill(drop.scatter(1, order, drop), -math.inf)
    if any(p.min_p for p in params):
        probs = x.softmax(dim=-1)
        floor = _column([p.min_p for p in params], dev) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, -math.inf)
    return x


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           prompts: Sequence[Sequence[int]] | None = None, outputs: Sequence[Sequence[int]] | None = None,
           eos: frozenset[int] = frozenset()) -> list[int]:
    """logits [R, V] (one row per request that needs a token) -> R token ids. `prompts[i]` /
    `outputs[i]`: row i's conversation ids and the ids it generated so far (needed when a row has
    penalties or min_tokens); `eos`: the model's EOS ids (`eos_ids`, for min_tokens)."""
    if logits.shape[0] != len(params):
        raise ValueError(f"sample: {logits.shape[0]} logit rows for {len(params)} requests")
    if not any(p.processed for p in params) and all(p.greedy for p in params):
        return logits.argmax(-1).tolist()
    x = process(logits, params, prompts, outputs, eos) if any(p.processed for p in params) else logits.float()
    _TOKENS.tick()
    out = x.argmax(-1).tolist()              # greedy rows are done; sampled rows overwritten below
    hot = [i for i, p in enumerate(params) if not p.greedy]
    if not hot:
        return out
    warped = warp(x[hot], [params[i] for i in hot])
    probs = warped.softmax(-1)
    # a temperature so low that logits / temperature overflow leaves no distribution: the turn is greedy there
    broken = (~torch.isfinite(probs).all(-1)).tolist()
    for j, i in enumerate(hot):
        if not broken[j]:
            out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return out


TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]   # (token, logprob, ((alt, logprob), ...))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """logits [R, V] (the rows `sample` drew `tokens` from) -> per row the chosen token's log-probability
    under log_softmax(logits) and the `tops[i]` most likely tokens with theirs (descending)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: list[TokenLogprob] = []
    for i, (t, k) in enumerate(zip(tokens, tops, strict=True)):
        alts: tuple[tuple[int, float], ...] = ()
        if k:
            v, ids = torch.topk(lp[i], k)
            alts = tuple(zip(ids.tolist(), v.tolist()))
        out.append((int(t), float(lp[i, t]), alts))
    return out
