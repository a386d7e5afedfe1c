"""SLO-aware admission (LayerKV §3.1): admit queued prefills only while their predicted prefill time
fits in the smallest TPOT slack of the running decodes.

For a running decode i with n_h tokens generated, t_h seconds since its first token, n_f predicted
remaining tokens and t_f = n_f · (current decode step seconds):
    Δt_i = T_tpot · (n_h + n_f) − (t_h + t_f)
Queued prefills j = 1..k (FCFS) are admitted while Σ_j T_prefill(n_j) ≤ min_i Δt_i; with nothing
decoding the allowance is infinite (nothing starves). T_prefill(n) = a + b·n + c·n², fitted by least
squares to the (prefill rows, step seconds) pairs the engine observes; n_f from a percentile of
observed output lengths (per session when it has history, else global).
"""

from __future__ import annotations

import math
import numbers
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

import numpy as np

from .request import Request, RequestStatus


def check_slo(name: str, value) -> float | None:
    """None (no SLO) or a positive finite number of seconds; anything else is a ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


class PrefillProfile:
    """T_prefill(n) = a + b·n + c·n² over the last `window` observed (rows, seconds) points.
    Until `min_points` distinct n are seen: the largest observed seconds-per-row times n, or, with no
    observation at all, `prior_seconds_per_token` · n (conservative: a CPU-sized per-row cost)."""

    def __init__(self, prior_seconds_per_token: float = 1e-3, window: int = 256, min_points: int = 3):
        self.prior = prior_seconds_per_token
        self.min_points = min_points
        self.points: deque[tuple[int, float]] = deque(maxlen=window)   # (rows >= 1, seconds >= 0)
        self._coef: np.ndarray | None = None                            # [a, b, c], stale when None

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds >= 0:
            self.points.append((rows, seconds))
            self._coef = None

    def coefficients(self) -> np.ndarray | None:
        """[a, b, c] of the least-squares fit, or None while fewer than `min_points` distinct n."""
        if self._coef is None and len({n for n, _ in self.points}) >= self.min_points:
            n = np.array([p[0] for p in self.points], dtype=np.float64)            # [P]
            y = np.array([p[1] for p in self.points], dtype=np.float64)            # [P]
            x = np.stack([np.ones_like(n), n, n * n], axis=1)                      # [P, 3]
            self._coef = np.linalg.lstsq(x, y, rcond=None)[0]                      # [3]
        return self._coef

    def predict(self, rows: int) -> float:
        """Predicted seconds (>= 0) to prefill `rows` rows."""
        if rows <= 0:
            return 0.0
        coef = self.coefficients()
        if coef is not None:
            return max(float(coef[0] + coef[1] * rows + coef[2] * rows * rows), 0.0)
        rate = max((s / n for n, s in self.points), default=self.prior)
        return rate * rows


class OutputLengths:
    """Conservative percentile of finished requests' output lengths, per session and global."""

    def __init__(self, percentile: float = 90.0, window: int = 1024):
        self.percentile, self.window = percentile, window
        self.all: deque[int] = deque(maxlen=window)
        self.by_session: defaultdict[str, deque[int]] = defaultdict(lambda: deque(maxlen=64))

    def observe(self, session_id: str, n: int) -> None:
        self.all.append(n)
        self.by_session[session_id].append(n)

    def forget(self, session_id: str) -> None:
        self.by_session.pop(session_id, None)

    def predict_total(self, session_id: str, cap: int) -> int:
        """Predicted total output tokens of a turn of `session_id`, at most `cap` (its max_new_tokens);
        `cap` itself before anything has been observed."""
        seen = self.by_session.get(session_id) or self.all
        if not seen:
            return cap
        return min(int(np.percentile(np.fromiter(seen, dtype=np.float64), self.percentile, method="higher")), cap)


class SloPolicy:
    """The admission gate and the profiles it learns from. `clock` is injectable for tests."""

    def __init__(self, ttft_slo: float | None, tpot_slo: float | None, *, percentile: float = 90.0,
                 prior_seconds_per_token: float = 1e-3, clock: Callable[[], float] = time.monotonic):
        self.ttft_slo, self.tpot_slo = check_slo("ttft_slo", ttft_slo), check_slo("tpot_slo", tpot_slo)
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
        self.prefill = PrefillProfile(prior_seconds_per_token)
        self.outputs = OutputLengths(percentile)
        self.decode_step: float | None = None      # EMA of steps with decode rows only (seconds)
        self.last_step: float | None = None        # any step, the fallback before a pure decode step
        self.deferred = 0                          # admissions the gate postponed (one per step at most)
        self.clock = clock

    # ---- learning, called by the engine after each committed step / finished request ------------

    def observe_step(self, prefill_rows: int, decode_rows: int, seconds: float) -> None:
        self.last_step = seconds
        if prefill_rows:
            self.prefill.observe(prefill_rows, seconds)
        elif decode_rows:
            self.decode_step = seconds if self.decode_step is None else 0.5 * (self.decode_step + seconds)

    def observe_finished(self, r: Request) -> None:
        if r.status is RequestStatus.FINISHED:
            self.outputs.observe(r.session_id, len(r.output_ids))

    # ---- the gate -------------------------------------------------------------------------------

    def slack(self, r: Request, now: float) -> float:
        """Δt_i of a decoding request (seconds; may be negative). Needs `tpot_slo`."""
        assert self.tpot_slo is not None and r.first_token_at is not None, r
        n_h = len(r.output_ids)
        t_h = now - r.first_token_at
        total = self.outputs.predict_total(r.session_id, r.sampling.max_new_tokens)
        n_f = max(min(total, r.sampling.max_new_tokens) - n_h, 1)      # a positive integer (LayerKV)
        step = self.decode_step if self.decode_step is not None else (self.last_step or 0.0)
        return self.tpot_slo * (n_h + n_f) - (t_h + n_f * step)

    def allowance(self, running: Iterable[Request]) -> float:
        """min_i Δt_i over the running requests that have a first token; inf when none decodes or
        no TPOT SLO is set (then admission is today's rule)."""
        if self.tpot_slo is None:
            return math.inf
        now = self.clock()
        return min((self.slack(r, now) for r in running if r.first_token_at is not None and r.output_ids),
                   default=math.inf)

    def prefill_seconds(self, rows: int) -> float:
        return self.prefill.predict(rows)
