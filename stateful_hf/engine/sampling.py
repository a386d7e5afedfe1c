"""Sampling parameters of one request and the sampler that turns a step's logits into tokens."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .constraint import JsonConstraint

MAX_LOGPROBS = 20          # OpenAI's bound on top_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one turn is decoded.

    temperature 0 means greedy (argmax; top_p / top_k / seed are then unused). EOS ids come from the
    model's generation config and end the turn unless `ignore_eos`. `stop_token_ids` end it too (the
    stop token is kept in `token_ids`, as `generate` keeps EOS). `stop` strings need a tokenizer; the
    text is cut before the first occurrence.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                           # 0 = no top-k filter
    seed: int | None = None                  # per-request torch.Generator when sampling
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True         # for the decoded text only
    # log-probabilities of the chosen tokens (the model's distribution: before temperature / top-p /
    # top-k) with this many most likely alternatives each (0..20); None: not computed
    logprobs: int | None = None
    # structured output: decode only JSON, any object ("json_object") or matching a JSON schema (a dict,
    # JSON text or pydantic model class); made a `constraint.JsonConstraint` here. None: free decoding
    constraint: JsonConstraint | None = None

    def __post_init__(self) -> None:
        if self.constraint is not None:         # only a constrained request imports constraint.py
            from .constraint import json_constraint
            object.__setattr__(self, "constraint", json_constraint(self.constraint))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_generation_config(cls, generation_config, **explicit) -> SamplingParams:
        """Defaults in one precedence: `explicit` fields (the caller's arguments or request fields;
        pass only those given), then the model's generation config (as vLLM's
        `--generation-config auto`), then this class's defaults. Greedy unless the generation config
        sets do_sample=True; then its temperature / top_p / top_k, with generate's global defaults
        (1.0 / 1.0 / 50) for the ones it leaves unset. max_new_tokens from its max_new_tokens (its
        max_length counts the prompt, so it is not used). Options the engine does not implement
        (repetition_penalty, ...) are named in a warning: with them the engine differs from generate."""
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
            ignored = [f"{k}={getattr(cfg, k)!r}" for k, neutral in _UNSUPPORTED
                       if getattr(cfg, k, None) not in (None, neutral) and k not in explicit]
            if ignored:
                warnings.warn(f"the model's generation config sets {', '.join(ignored)}, which the engine does not "
                              "implement: its tokens can differ from generate's", stacklevel=2)
        fields.update(explicit)
        return cls(**fields)


def _or(value, default):
    return default if value is None else value


# generation config options that change which token is chosen, with their neutral values
_UNSUPPORTED = (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("min_new_tokens", 0),
                ("min_length", 0), ("bad_words_ids", None), ("suppress_tokens", None),
                ("begin_suppress_tokens", None), ("forced_eos_token_id", None), ("num_beams", 1),
                ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0), ("min_p", None))


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


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already divided by temperature) with tokens outside top-k / top-p set to -inf."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits [R, V] (one row per request that needs a token) -> R token ids."""
    if logits.shape[0] != len(params):
        raise ValueError(f"sample: {logits.shape[0]} logit rows for {len(params)} requests")
    out = logits.argmax(-1).tolist()          # greedy rows are done; sampled rows overwritten below
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        row = _filter(logits[i].float() / p.temperature, p.top_k, p.top_p)
        out[i] = int(torch.multinomial(row.softmax(-1), 1, generator=gen))
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
