"""A request (one turn of one session): its state, owned by the scheduler, and its results.

A `Request` changes only through its own methods (`asked`, `admit`, `advance`, `emit`, `suspend`, `finish`, ...),
called by the scheduler on the stepping thread; `request_cancel` is the one any thread may call.
`tests/test_architecture.py` checks that no other module assigns its fields, and that admission and layer offload
call none of these methods (they return verdicts the scheduler applies).

`Rows`: a turn's rows still to feed, read in place (a request's own, or what admitting it would take).

`WorkItem`: one request's rows in one step, and how the next rows of a request are cut.

`RequestHandle`: what `Engine.submit` returns. Stream tokens or text, wait, cancel; sync or async.
`Progress`: one consistent read of a handle's published state (what a server's stream sends from).
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..cache.doors.engine import TurnNeeds, TurnStats
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
    missing_ids: list[int] = field(default_factory=list)  # the token ids at `missing`
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)          # with sampling.logprobs: one per output id
    text: OutputText | None = None                        # decoded output (with a tokenizer)
    leased: bool = False                                  # holds its session's lease (store.begin .. store.end)
    # The store's latest answer for this turn (`TurnNeeds`): when queued, what admitting it would take;
    # once running, its continuing turn after each committed step (keep = the session's history).
    needs: TurnNeeds | None = None
    needs_pass: tuple[int, int] | None = None             # (scheduler pass, its store epoch) `needs` was asked for
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
    # Structured output: the matcher of the request's grammar (`grammar.Grammar`, set by `Engine.submit`
    # when sampling has a constraint), advanced by each emitted token. None: free decoding.
    grammar: object | None = None
    # A warm-up (`warmup.py`): its prompt is the session's own history; it brings that history's KV up,
    # discards its one sampled token and yields to any turn of the session.
    warmup: bool = False

    # ---- its changes: the only writers of its fields ---------------------------------------------------

    def asked(self, needs: TurnNeeds | None, pass_: tuple[int, int] | None) -> None:
        """The store's answer for admitting it (`turn_needs`), asked in scheduler pass `pass_`; None: refused,
        or to be asked again (`pass_` None)."""
        self.needs, self.needs_pass = needs, pass_

    def prepare(self, rows: Rows) -> None:
        """The rows it feeds once admitted (queued: as the store answered, `Rows.answered`)."""
        self.pending, self.missing, self.missing_ids = list(rows.pending), list(rows.missing), list(rows.missing_ids)

    def admit(self, turn: TurnStats) -> None:
        """Its turn began in the store (`begin` answered `turn`): it holds the session's lease."""
        self.leased, self.truncated, self.reused = True, turn.truncated_tokens, turn.reused_tokens

    def start(self, swapped: int) -> None:
        """It runs from this step on; `swapped`: kept tokens its steps bring up from below the device."""
        self.status = RequestStatus.RUNNING
        self.swapped += swapped

    def set_factor(self, factor: int) -> None:
        """The keep factor of the chunks it fills from now on (layerwise_kv)."""
        self.factor = factor

    def pushed(self, needs: TurnNeeds, factor: int | None) -> None:
        """Its kept layers (or device chunks) were pushed down to the host: `needs`, the store's answer after;
        `factor` (None: unchanged), the keep factor of the chunks it fills from now on."""
        self.needs = needs
        self.factor = self.factor if factor is None else factor

    def mark_short(self, short: bool) -> None:
        """Whether it is a short turn, served before long prefills (fixed while it is queued)."""
        self.short = short

    def scheduled(self, at: float) -> None:
        """It is in a step that started at `at` (the first one sets its queue time)."""
        self.scheduled_at = self.scheduled_at or at

    def advance(self, item: WorkItem, needs: TurnNeeds | None) -> None:
        """A committed step ran `item`; `needs`: the store's answer for its continuing turn (None: unchanged)."""
        self.needs = needs if needs is not None else self.needs
        n = len(item.recompute)
        self.missing, self.missing_ids = self.missing[n:], self.missing_ids[n:]
        self.recomputed += n
        self.pending = self.pending[len(item.new_ids):]
        self.computed += item.num_tokens

    def emit(self, token: int, now: float) -> None:
        """It sampled `token` at `now`: an output id, fed to the next step unless the request ends first."""
        self.output_ids.append(token)
        self.first_token_at = self.first_token_at or now
        self.pending = [token]

    def add_logprob(self, entry) -> None:
        """The log-probabilities of the token it just emitted (`sampling.TokenLogprob`)."""
        self.logprobs.append(entry)

    def suspend(self, needs: TurnNeeds) -> None:
        """Its KV was moved down: it is requeued, its lease kept; `needs`: the store's answer after."""
        self.status = RequestStatus.SUSPENDED
        self.suspensions += 1
        self.needs = needs
        self.missing, self.missing_ids = list(needs.missing), list(needs.missing_ids)

    def release(self) -> None:
        """Its lease went back to the store (`end`)."""
        self.leased = False

    def finish(self, status: RequestStatus, reason: str, error: BaseException | None = None) -> None:
        """It ended (FINISHED, CANCELLED or FAILED) for `reason`."""
        assert status.done and not self.leased, (status, self.leased)
        self.status, self.finish_reason, self.error, self.finished_at = status, reason, error, time.monotonic()

    def request_cancel(self) -> None:
        """Ask it to end after the current step: the one change any thread may make."""
        self.cancel_requested = True

    def bind(self, prompt: list[int], generator: torch.Generator | None, text: OutputText | None) -> None:
        """At submit, before it is queued: its checked prompt ids, sampling generator and output text."""
        self.prompt, self.generator, self.text = prompt, generator, text

    def constrain(self, grammar: object, sampling: SamplingParams) -> None:
        """At submit, before it is queued: its grammar's matcher and the sampling that stops on its stop ids."""
        self.grammar, self.sampling = grammar, sampling

    def rows(self) -> Rows:
        """Its rows still to feed, read in place (not copied: valid until it next changes)."""
        return Rows(self.missing, self.missing_ids, self.pending)

    @property
    def length(self) -> int:
        """The session's history tokens (known once admitted: `needs.keep`)."""
        return self.needs.keep if self.needs is not None else 0

    def prefill_rows(self) -> int:
        """Rows before the first token: the prompt past the kept prefix plus dropped history before it
        (queued: as the store last answered), or the pending ids plus evicted history (suspended)."""
        if self.status is RequestStatus.SUSPENDED:
            return len(self.pending) + len(self.missing)
        return len(self.prompt) if self.needs is None else self.needs.prefill_rows(len(self.prompt))

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


@dataclass(frozen=True, slots=True)
class Rows:
    """A turn's rows still to feed, in order: history positions to recompute (ascending) with their ids, then
    the ids to append. Sequences read in place, never changed through it."""

    missing: Sequence[int]
    missing_ids: Sequence[int]
    pending: Sequence[int]

    @classmethod
    def answered(cls, prompt: Sequence[int], needs: TurnNeeds) -> Rows:
        """What admitting a queued turn takes, as the store answered: its dropped history, the prompt past `keep`."""
        return cls(needs.missing, needs.missing_ids, prompt[needs.keep:])

    def keeping(self, still: Set[int]) -> Rows:
        """Only the missing positions in `still` (the store's answer after the turn began: a cut shared chunk
        copied on write kept its KV)."""
        kept = [(p, t) for p, t in zip(self.missing, self.missing_ids, strict=True) if p in still]
        return Rows(tuple(p for p, _ in kept), tuple(t for _, t in kept), self.pending)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request's rows in a step: recomputed history positions (whole chunks, ascending), then new
    ids appended at positions start .. start + len(new_ids) - 1. One store entry."""

    request: Request
    recompute: tuple[int, ...]
    recompute_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    start: int                         # session length before the step
    needs_logits: bool                 # the last row is the last pending token: sample after it
    factor: int = 1                    # keep factor of the chunks it fills (layerwise_kv; 1: all layers)

    @property
    def num_tokens(self) -> int:
        return len(self.recompute) + len(self.new_ids)

    def entry(self) -> tuple[str, list[int], list[int]]:
        pos = list(self.recompute) + list(range(self.start, self.start + len(self.new_ids)))
        return self.request.session_id, list(self.recompute_ids) + list(self.new_ids), pos


def next_item(r: Request, budget: int, length: int, block_size: int, rows: Rows | None = None) -> WorkItem | None:
    """The next of `rows` (default: r's own) within `budget` tokens, for a session of `length` tokens:
    whole missing chunks first, new ids only once nothing before them is missing. None if nothing fits."""
    rows = r.rows() if rows is None else rows
    recompute: list[int] = []
    for k in sorted({p // block_size for p in rows.missing}):
        chunk = [p for p in rows.missing if p // block_size == k]
        if len(recompute) + len(chunk) > budget:
            break
        recompute += chunk
    new: Sequence[int] = ()
    if len(recompute) == len(rows.missing):
        new = rows.pending[: budget - len(recompute)]
    if not recompute and not new:
        return None
    ids = dict(zip(rows.missing, rows.missing_ids, strict=True)) if recompute else {}
    return WorkItem(r, tuple(recompute), tuple(ids[p] for p in recompute), tuple(new), length,
                    needs_logits=bool(new) and len(new) == len(rows.pending), factor=r.factor)


def whole_item(r: Request, keep: int, rows: Rows | None = None) -> WorkItem:
    """All of `rows` (default: r's own) as one item at keep factor 0 (so host chunks count as in place)."""
    rows = r.rows() if rows is None else rows
    return WorkItem(r, tuple(rows.missing), (), tuple(rows.pending), keep, False, factor=0)


def item_end(item: WorkItem) -> int:
    """One past the item's last row position."""
    return max(item.start + len(item.new_ids), max(item.recompute, default=-1) + 1)


def blocks_needed(item: WorkItem) -> int:
    """Device blocks the store must give this item (`TurnNeeds.blocks` of its request's turn): chunks
    up to its last row that are not on the device. A layer-wise item (factor != 1) fills its chunks
    with residue blocks, ceil(n / f) blocks at most, and reads host chunks in place."""
    needs = item.request.needs
    assert needs is not None, item     # a request with work items has the store's answer
    return needs.blocks(item_end(item), item.factor)


def chunk_needs(item: WorkItem):
    """The ChunkNeeds of the item: (chunks it fills, copies up, reads in place) (`TurnNeeds.needs`)."""
    needs = item.request.needs
    assert needs is not None, item
    return needs.needs(item_end(item), item.factor)


@dataclass(frozen=True, slots=True)
class Progress:
    """A handle's published state, read at once (`RequestHandle.progress`). `logprobs` and `ends` are
    index-aligned with `tokens` (both empty unless the request asked for logprobs; `ends` also without a
    tokenizer): `ends[i]` is where token i's text ends in the decoded output (`text.OutputText.ends`)."""

    tokens: tuple[int, ...]
    text: str                          # the stable text: what may be streamed now
    logprobs: tuple                    # one sampling.TokenLogprob per token (with SamplingParams.logprobs)
    ends: tuple[int, ...]
    output: RequestOutput | None       # the final output once the request has ended


class Loop(Protocol):
    """What a handle needs of the engine's step loop (`step_loop.StepLoop`)."""

    cv: threading.Condition      # guards handles' published state; notified after every step

    def wait_until(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait for `pred`, driving the steps in this thread when no background loop runs."""

    def start(self) -> None:
        """Start the background loop (idempotent)."""


class RequestFailed(RuntimeError):
    """`result()` of a request that failed; the cause is chained (`__cause__`) and in `output.error`."""

    def __init__(self, output: RequestOutput):
        super().__init__(f"request {output.request_id} of session {output.session_id!r} failed: {output.error}")
        self.output = output


class RequestHandle:
    """Published to by the engine's stepping thread; read from any thread.

    If the engine has no background loop running, waiting on a handle drives the engine's steps
    in the calling thread (so `submit(...).result()` works without `start()`). Collaborators: the
    engine's `loop` (its condition guards this handle's published state) and `cancel(request_id)`.
    """

    def __init__(self, request_id: int, session_id: str, loop: Loop, cancel: Callable[[int], None]):
        self.request_id = request_id
        self.session_id = session_id
        self._loop, self._cancel = loop, cancel
        self._cv = loop.cv                    # the engine's condition: notified after every step
        self._tokens: list[int] = []
        self._text = ""
        self._stable = 0                      # chars of _text that may be streamed
        self._logprobs: tuple = ()            # one per token (with SamplingParams.logprobs)
        self._ends: tuple[int, ...] = ()      # per token: where its text ends in _text (with logprobs)
        self._output: RequestOutput | None = None

    def __repr__(self) -> str:
        state = self._output.finish_reason if self._output else "running"
        return f"RequestHandle(id={self.request_id}, session={self.session_id!r}, {state})"

    # ---- engine side ----------------------------------------------------------------------------

    def publish(self, tokens: list[int], text: str, stable: int, output: RequestOutput | None = None,
                logprobs: Sequence = (), ends: Sequence[int] = ()) -> None:
        """The engine's stepping thread: the tokens and text so far (`stable` chars may be streamed), their
        log-probabilities and text ends (`Progress`); `output` once the request has ended. The only writer
        of this handle's state."""
        with self._cv:
            self._tokens, self._text, self._stable = list(tokens), text, stable
            self._logprobs, self._ends = tuple(logprobs), tuple(ends)
            if output is not None:
                self._output = output
            self._cv.notify_all()

    # ---- reader side ----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._output is not None

    def snapshot(self) -> tuple[list[int], str, RequestOutput | None]:
        """(tokens so far, the stable text so far, the final output or None), read consistently."""
        with self._cv:
            return list(self._tokens), self._text[:self._stable], self._output

    def progress(self) -> Progress:
        """Tokens, stable text, log-probabilities and text ends so far, and the final output, read consistently."""
        with self._cv:
            return Progress(tuple(self._tokens), self._text[:self._stable], self._logprobs, self._ends, self._output)

    def cancel(self) -> None:
        """Ask the engine to stop this request after the current step (no-op if already done)."""
        self._cancel(self.request_id)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request ends (never raises for its failure). Returns whether it has ended."""
        return self._wait(lambda: self._output is not None, timeout)

    def _wait(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        return self._loop.wait_until(pred, timeout)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request ends. Raises RequestFailed if it failed; a cancelled request returns
        its partial output with finish_reason "cancelled"."""
        self._wait(lambda: self._output is not None, timeout)
        if self._output is None:
            raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
        if self._output.error is not None:
            raise RequestFailed(self._output) from self._output.error
        return self._output

    def output(self) -> RequestOutput | None:
        """The final output (also for a failed request), or None while it runs."""
        return self._output

    def _next_tokens(self, seen: int) -> tuple[list[int], bool]:
        """Block until there are more than `seen` tokens or the request is done; (the new ones, done)."""
        self._wait(lambda: len(self._tokens) > seen or self._output is not None)
        with self._cv:
            new = self._tokens[seen:]
            return new, self._output is not None and not new

    def _next_text(self, seen: int) -> tuple[str, bool]:
        """Block until there are more than `seen` stable chars or the request is done; (the new ones, done)."""
        self._wait(lambda: self._stable > seen or self._output is not None)
        with self._cv:
            return self._text[seen:self._stable], self._output is not None

    def __iter__(self) -> Iterator[int]:
        """Generated token ids as they are sampled. Ends when the request ends (see `result()`)."""
        seen = 0
        while True:
            new, done = self._next_tokens(seen)
            yield from new
            seen += len(new)
            if done or (not new and self._output is not None):
                return

    def text_deltas(self) -> Iterator[str]:
        """Pieces of the decoded text as they become stable (needs the engine's tokenizer)."""
        seen = 0
        while True:
            new, done = self._next_text(seen)
            if new:
                yield new
                seen += len(new)
            if done:
                return

    # ---- asyncio --------------------------------------------------------------------------------

    async def aresult(self) -> RequestOutput:
        self._loop.start()
        return await asyncio.to_thread(self.result)

    async def __aiter__(self) -> AsyncIterator[int]:
        self._loop.start()
        seen = 0
        while True:
            new, done = await asyncio.to_thread(self._next_tokens, seen)
            for t in new:
                yield t
            seen += len(new)
            if done or (not new and self._output is not None):
                return

    async def atext_deltas(self) -> AsyncIterator[str]:
        self._loop.start()
        seen = 0
        while True:
            new, done = await asyncio.to_thread(self._next_text, seen)
            if new:
                yield new
                seen += len(new)
            if done:
                return
