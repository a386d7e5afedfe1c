"""A request (one turn of one session): its state, owned by the scheduler, and its results."""

from __future__ import annotations

import enum
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .text import OutputText


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued; no lease on the session yet
    RUNNING = "running"        # admitted: holds the session's lease; prefilling or decoding
    SUSPENDED = "suspended"    # holds the lease, its KV was moved down (evicted); requeued
    FINISHED = "finished"      # ended by EOS / stop / max_new_tokens (see finish_reason)
    CANCELLED = "cancelled"
    FAILED = "failed"          # error set on the request; other requests are unaffected

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Times in seconds (time.monotonic clock); token counts of this turn."""

    arrival_time: float
    queue_time: float | None           # arrival -> first scheduled in a step
    ttft: float | None                 # arrival -> first generated token
    tpot: float | None                 # mean time per output token after the first
    latency: float | None              # arrival -> finished
    prompt_tokens: int                 # the conversation ids submitted
    output_tokens: int
    reused_tokens: int                 # history tokens served from stored KV (any tier), not recomputed
    swapped_tokens: int                # of which brought up from a lower tier (host/disk copy, hidden rebuild)
    recomputed_tokens: int             # history tokens recomputed (dropped, or evicted by a suspension)
    truncated_tokens: int              # history cut because the prompt diverged from it (an edit)
    suspensions: int
    # SLO outcome: None without that SLO or when the metric is undefined (no token / one token).
    ttft_slo_violated: bool | None = None      # ttft > ttft_slo
    tpot_slo_violated: bool | None = None      # tpot > tpot_slo


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: int
    session_id: str
    token_ids: tuple[int, ...]         # generated ids (a stop token / EOS included, as generate does)
    text: str | None                   # decoded generated text (None without a tokenizer)
    finish_reason: str | None          # "stop", "length", "cancelled", "error"
    metrics: RequestMetrics
    error: BaseException | None = None
    logprobs: tuple | None = None      # with SamplingParams.logprobs: one sampling.TokenLogprob per token_ids


@dataclass(slots=True, eq=False)
class Request:
    """Mutable state of one turn. Only the scheduler (on the stepping thread) changes it, except
    `cancel_requested`, a flag any thread may set."""

    request_id: int
    session_id: str
    prompt: list[int]                    # the whole conversation's ids
    sampling: SamplingParams
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # Set at admission, consumed by steps:
    pending: list[int] = field(default_factory=list)      # ids to append to the session, not yet fed
    missing: list[int] = field(default_factory=list)      # history positions to recompute (ascending)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)          # with sampling.logprobs: one per output id
    text: OutputText | None = None                        # decoded output (with a tokenizer)
    lease: AbstractContextManager | None = None
    finish_reason: str | None = None
    error: BaseException | None = None
    cancel_requested: bool = False
    # Metrics.
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    reused: int = 0
    swapped: int = 0
    computed: int = 0
    recomputed: int = 0
    truncated: int = 0
    suspensions: int = 0
    cache_salt: str | None = None         # scopes prefix sharing within the session's tenant (vLLM's)
    # Layer-wise allocation (layerwise_kv): keep factor of the chunks this turn fills (1: all layers on
    # the device, 0: none, f >= 2: l % f == r), chosen at admission, lowered when its layers are pushed down.
    factor: int = 1
    # Set by the scheduler when it queues the request: at most `short_prefill_tokens` rows before its first
    # token (an estimate, for the order of service only: short turns are served before long prefills).
    short: bool = False

    @property
    def decoding(self) -> bool:
        """One sampled token to feed and nothing to recompute: a 1-row step entry."""
        return bool(self.output_ids) and len(self.pending) == 1 and not self.missing

    def metrics(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> RequestMetrics:
        a, first, end, n = self.arrival, self.first_token_at, self.finished_at, len(self.output_ids)
        ttft = None if first is None else first - a
        tpot = (end - first) / (n - 1) if first is not None and end is not None and n > 1 else None
        return RequestMetrics(
            arrival_time=a,
            queue_time=None if self.scheduled_at is None else self.scheduled_at - a,
            ttft=ttft,
            tpot=tpot,
            latency=None if end is None else end - a,
            prompt_tokens=len(self.prompt), output_tokens=n, reused_tokens=self.reused, swapped_tokens=self.swapped,
            recomputed_tokens=self.recomputed, truncated_tokens=self.truncated, suspensions=self.suspensions,
            ttft_slo_violated=None if ttft_slo is None or ttft is None else ttft > ttft_slo,
            tpot_slo_violated=None if tpot_slo is None or tpot is None else tpot > tpot_slo,
        )
