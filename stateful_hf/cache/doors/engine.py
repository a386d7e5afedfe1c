"""`EngineStore`: the store as the engine sees it (scheduler, admission, runner, layer offload, warm-ups, hints),
with the value objects that cross the door. The engine imports this module and nothing else of the store;
`SessionStore` keeps the protocol (mypy checks the engine against it, `tests/test_architecture.py` the imports).

Every method takes the store lock. A method marked *reads* changes nothing; one marked *changes* says what.
Values that cross are frozen: `TurnNeeds` (what a turn would take), `Room` (what a step could get),
`PoolSizes`, `StepBatch` (a planned step: the engine runs it and hands it back), `Committed` (the room after a
step and each stepped session's continuing turn), `TurnStats` (a turn's counts, owned by the store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from ..eviction.policy import CostProfile
from ..movement.moves import MoveLedger
from ..sessions.session import TurnStats
from ..sessions.tenant import DEFAULT_TENANT, session_key
from ..spec import KVSpec
from ..step import StepBatch
from ..turn import Committed, Place, PoolSizes, Room, TurnNeeds, blocks_at_most

if TYPE_CHECKING:
    from ..audit.stats import FlushReport

__all__ = ["DEFAULT_TENANT", "CapacityError", "Committed", "CostProfile", "EngineStore", "KVSpec",
           "Place", "PoolSizes", "Room", "SessionBusyError", "StepBatch", "StoreError", "TurnNeeds", "TurnStats",
           "UnknownSessionError", "blocks_at_most", "session_key"]


class EngineStore(Protocol):
    """What the engine asks of the store and tells it. A turn's path: `turn_needs` (may the turn be admitted?),
    `begin` (lease, cut), then per step `plan_step` -> forward -> `commit` (or `abort`), then `end` (release)."""

    # ---- facts fixed when the store was made ---------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per chunk (one device block holds one chunk of one session)."""
        ...

    @property
    def spec(self) -> KVSpec:
        """The KV geometry: layers, heads, head dim, dtype, device."""
        ...

    @property
    def layerwise(self) -> bool:
        """Whether the store was made with layerwise_kv (LayerKV): `offload_layers` then frees blocks."""
        ...

    @property
    def keeps_hidden(self) -> bool:
        """Whether the store keeps hidden states (HCache): its steps may rebuild layers, and do not compile."""
        ...

    @property
    def invariant_split(self) -> int | None:
        """The split the store's forwards run `batch_invariant` with; None: stock kernels."""
        ...

    @property
    def cost_profile(self) -> CostProfile | None:
        """The cost profile the eviction policy's keys read (None: a policy that reads none)."""
        ...

    def use_cost_profile(self, profile: CostProfile) -> None:
        """Changes: the cost profile the eviction policy's keys read (the engine's online correction); a
        policy whose keys read none ignores it."""
        ...

    @property
    def moves(self) -> MoveLedger:
        """The ledger of chunk moves between tiers (the engine's swap-in cost correction subscribes to it:
        a listener runs under the store lock and must not call into the store)."""
        ...

    @property
    def clock(self) -> Callable[[], float]:
        """The store's clock, in seconds (the time `expect` and `due` speak in)."""
        ...

    @property
    def pool_sizes(self) -> PoolSizes:
        """The device and host pools' sizes."""
        ...

    # ---- reads: they change nothing ----------------------------------------------------------------

    def __contains__(self, session_id: str) -> bool:
        """Reads: whether the session exists (with a history, or opened by `turn_needs`)."""
        ...

    def is_busy(self, session_id: str) -> bool:
        """Reads: whether a turn holds the session's lease (False for an unknown session)."""
        ...

    def num_tokens(self, session_id: str) -> int:
        """Reads: tokens of the session's history; 0 for an unknown session."""
        ...

    def token_ids(self, session_id: str) -> list[int]:
        """Reads: a copy of the session's history (UnknownSessionError if none)."""
        ...

    def places(self, session_id: str) -> tuple[Place, ...]:
        """Reads: where each chunk of the session's history is."""
        ...

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        """Reads: history positions a step must recompute, as after a cut to `cut`."""
        ...

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Reads: the longest common prefix of the session's history and `token_ids`."""
        ...

    def room(self) -> Room:
        """Reads: what a step could get now (free blocks plus idle sessions')."""
        ...

    def free_blocks(self) -> int:
        """Reads: device blocks on the free list now (idle sessions' blocks are not free; `room` counts them)."""
        ...

    def held_blocks(self, session_id: str) -> float:
        """Reads: device blocks the session holds (a residue block counts 1/f)."""
        ...

    def available_host_blocks(self) -> int:
        """Reads: host slots a step could get now (free, or idle sessions')."""
        ...

    def due(self, within: float) -> tuple[list[str], float]:
        """Changes: pops the expectations due within `within` seconds (each returned once, soonest first);
        returns them and the clock time of the next one still pending (inf: none)."""
        ...

    def offload_bandwidth(self) -> float:
        """Reads: bytes per second of one layer's blocks copied device -> host (measured once, memoized)."""
        ...

    # ---- a turn ------------------------------------------------------------------------------------

    def turn_needs(self, session_id: str, prompt: Sequence[int] | None = None,
                   cache_salt: str | None = None) -> TurnNeeds:
        """What admitting a turn with `prompt` (the whole conversation) would take; `prompt` None: the leased
        session's turn continuing. Changes: opens the session if new; an idle one adopts the prompt's shared
        prefix (ValueError: another `cache_salt` than the session's)."""
        ...

    def begin(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None, *,
              keep: int | None = None) -> TurnStats:
        """Changes: leases the session (SessionBusyError if leased) and cuts its history to `keep` (the kept
        prefix `turn_needs` answered; StoreError if the session changed since). On error nothing is held."""
        ...

    def end(self, session_id: str, generated: int) -> Room:
        """Changes: the leased turn's `generated` tokens are counted and the lease released. Returns the room."""
        ...

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> StepBatch:
        """Changes: reserves device blocks for one forward of (session id, token ids, positions) rows, copies
        their context up and appends the ids to the histories. Hand the step back by `commit` or `abort`."""
        ...

    def commit(self, step: StepBatch) -> Committed:
        """Changes: makes the planned step permanent (the rows' K/V are the sessions'). Returns the room after
        and each stepped session's continuing turn."""
        ...

    def abort(self, step: StepBatch) -> None:
        """Changes: undoes `plan_step`: histories and blocks as before it."""
        ...

    # ---- moving KV ---------------------------------------------------------------------------------

    def evict(self, session_id: str) -> int:
        """Changes: the session's device chunks go one tier down (also when busy). Returns blocks freed."""
        ...

    def move(self, session_id: str, chunks: Iterable[int], tier: str, reason: str = "explicit") -> None:
        """Changes: chosen chunks of an idle session go to `tier` ("device", "host", ...), counted as `reason`."""
        ...

    def offload_layers(self, session_id: str, full: bool = False) -> int:
        """Changes: LayerKV's push-down of a running request's layers. Returns device blocks freed (0
        without layerwise_kv)."""
        ...

    def expect(self, session_id: str, seconds: float) -> float:
        """Changes: the session's next turn is expected within `seconds`, clamped to the store's `max_retain`
        (ranked for eviction as if active then; `due` reports it). Returns the clock time it is expected at."""
        ...

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        """Changes: forgets the session and frees what only it holds."""
        ...

    def flush(self, timeout: float = 10.0) -> FlushReport | None:
        """Changes: writes to disk, within `timeout` seconds, the idle sessions' chunks not on disk yet, then
        commits the index (what a restart on the same disk finds). None without a disk tier."""
        ...
