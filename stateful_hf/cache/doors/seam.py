"""`SeamStore`: the store as the transformers seam sees it (`integration/hooks.py`: a stateful `generate`, a
restore; `integration/stateful_cache.py`: transformers' `Cache` over one session). A `generate` turn's path:
`lease` -> `begin_turn` (cut, classify) -> per forward `plan_step` -> forward -> `commit` (or `abort`) ->
`add_generated` -> the lease ends. Every method takes the store lock; *reads* change nothing."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from ..audit.stats import TurnStats
from ..step import StepBatch
from ..turn import Committed

__all__ = ["SeamStore", "StepBatch", "TurnStats"]


class SeamStore(Protocol):
    """What a stateful `generate` and a `StatefulCache` ask of the store and tell it."""

    @property
    def invariant_split(self) -> int | None:
        """The split the store's forwards run `batch_invariant` with; None: stock kernels."""
        ...

    def lease(self, session_id: str) -> AbstractContextManager[None]:
        """Changes: the session is busy for the block (SessionBusyError if it is already)."""
        ...

    def num_tokens(self, session_id: str) -> int:
        """Reads: tokens of the session's history; 0 for an unknown session."""
        ...

    def token_ids(self, session_id: str) -> list[int]:
        """Reads: a copy of the session's history."""
        ...

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        """Reads: history positions a step must recompute (their KV is stored nowhere)."""
        ...

    def begin_turn(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> TurnStats:
        """Changes: the leased session's turn starts with `prompt` (the whole conversation): the history is cut
        where it diverges; the returned stats (the session's last_turn) are filled as the turn runs."""
        ...

    def add_generated(self, session_id: str, n: int) -> None:
        """Changes: the turn's generated tokens are counted in its stats."""
        ...

    def truncate(self, session_id: str, length: int) -> int:
        """Changes: the history is cut to its first `length` tokens; returns how many were cut."""
        ...

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> StepBatch:
        """Changes: device blocks reserved for one forward of the rows, their context copied up, the ids
        appended. Hand the step back by `commit` or `abort`."""
        ...

    def commit(self, step: StepBatch) -> Committed:
        """Changes: the planned step is permanent (its rows are counted in the turn's stats)."""
        ...

    def abort(self, step: StepBatch) -> None:
        """Changes: `plan_step` undone: histories and blocks as before it."""
        ...
