"""The values the store answers a scheduler with: `Room` (what a step could get now) and `TurnNeeds`
(what admitting one turn would take), like vLLM's `KVCacheBlocks` between its scheduler and cache.

Frozen snapshots taken under the store lock: true when taken, stale once the store changes. A
scheduler decides with them and then acts through the store (`KVStore.begin`, `plan_step`), which
re-checks everything: a stale snapshot can cost a wasted try, never a wrong state.

A turn's layout when admitted, by position (bs = block size):

    | kept history: keep tokens                     | the prompt's new ids: pending
    | chunk 0 | chunk 1 | ...         | chunk ceil(keep/bs)-1 | new chunks (fills) ...
      places[k]: DEVICE/LAYERED read in place, CACHED/HOST/LOWER brought up, DROPPED recomputed
      (its positions are `missing`, their ids `missing_ids`)

Where each chunk of a session is, as a step sees it (`Place`), and what a step does with each chunk
below its last row: fill it (a fresh device block, the rows compute its KV), copy it up (a lower
tier, or only cached on the device), read it in place (DEVICE, LAYERED; a HOST chunk for a
layer-wise entry), or nothing. One classification (`place_of`), asked two ways: `needs` ahead of a
step (the engine's `TurnNeeds.blocks`, `Capacity.chunk_needs` / `blocks_needed`) and `entry_needs`
when the step planner plans it (validating the entry).

A step entry's keep factor (`factors` of `plan_step`, `factor` here) says how many of its layers
stay on the device: 1 all (every store), 0 or f >= 2 some (layerwise_kv stores only, `layerwise/`).
`check_factor` validates one; `blocks_at_most` bounds the device blocks its fills take.

Pure functions of a session's chunk table: they read, never mutate. Called with the store lock held.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..kernels.blocks import blocks_for
from .sessions.session import Chunk, ChunkState, Session


@dataclass(frozen=True, slots=True)
class Room:
    """What a step could get now."""

    device_blocks: int          # free device blocks plus idle sessions' (`Capacity.device_blocks`)
    host_blocks: int            # the same for host slots, with layerwise_kv (else 0)
    device_slots: int | None    # virtual layout: device slots busy sessions could still get; None if paged

    def __post_init__(self) -> None:
        assert self.device_blocks >= 0 and self.host_blocks >= 0, self


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """How big the device and host pools are: fixed when the store is made."""

    device_blocks: int          # blocks of the device pool
    host_blocks: int            # slots of the host pool; 0 without a host tier

    def __post_init__(self) -> None:
        assert self.device_blocks > 0 and self.host_blocks >= 0, self


@dataclass(frozen=True, slots=True)
class TurnNeeds:
    """What a turn of one session would take: its kept history and where that history is."""

    session_id: str
    busy: bool                         # another turn holds the session's lease: not admissible now
    keep: int                          # history tokens the turn keeps (`history.kept_prefix`)
    missing: tuple[int, ...]           # kept positions whose KV is stored nowhere: recomputed, ascending
    missing_ids: tuple[int, ...]       # the token ids at `missing`
    places: tuple[Place, ...]          # one per chunk of the kept history
    has_slot: bool | None              # virtual layout: the session holds a device slot; None if paged
    block_size: int
    room: Room

    def __post_init__(self) -> None:
        assert len(self.missing) == len(self.missing_ids), self
        assert len(self.places) == blocks_for(self.keep, self.block_size) or self.busy, self
        assert all(p < self.keep for p in self.missing), self

    @property
    def held(self) -> int:
        """Device blocks the session holds for its kept history."""
        return sum(p is Place.DEVICE for p in self.places)

    def stored_below(self) -> int:
        """Kept tokens stored below the device and not cached there: a step copies or rebuilds them up."""
        bs = self.block_size
        return sum(min((k + 1) * bs, self.keep) - k * bs for k, p in enumerate(self.places) if p in STORED_BELOW)

    def prefill_rows(self, prompt_len: int) -> int:
        """Rows before the turn's first token, for a prompt of `prompt_len` tokens."""
        return prompt_len - self.keep + len(self.missing)

    def needs(self, end: int, factor: int = 1) -> ChunkNeeds:
        """What a step of the turn reaching row `end` - 1 does with each chunk (`needs`)."""
        return needs(self.places, end, self.keep, factor, self.block_size)

    def blocks(self, end: int, factor: int = 1) -> int:
        """Device blocks such a step takes at most (as `Capacity.blocks_needed`)."""
        fills, copies, _ = self.needs(end, factor)
        return blocks_at_most(factor, len(fills)) + len(copies)


@dataclass(frozen=True, slots=True)
class Committed:
    """What a committed step leaves: the room, and each stepped session's continuing turn (keep = its
    history now), for the scheduler's next step."""

    room: Room
    turns: dict[str, TurnNeeds]
    device_free: int            # device blocks on the free list after the step (idle sessions' are not free)


DEVICE, DROPPED, HOST, LAYERED = ChunkState.DEVICE, ChunkState.DROPPED, ChunkState.HOST, ChunkState.LAYERED


class Place(enum.Enum):
    """Where a chunk's KV is, as a step sees it."""

    DEVICE = "device"      # a device block: read in place, holds one block
    LAYERED = "layered"    # per layer on host and in a residue block: read in place
    CACHED = "cached"      # a lower tier, still cached on the device (shadow): taken back, no copy
    HOST = "host"          # the host tier only: copied up, or read in place by a layer-wise step
    LOWER = "lower"        # hidden states or disk only: copied or rebuilt up
    DROPPED = "dropped"    # stored nowhere: recomputed


RESIDENT = (Place.DEVICE, Place.LAYERED)       # read in place by any step
STORED_BELOW = (Place.HOST, Place.LOWER)       # brought up by a step: a swap-in or rebuild, not a recompute


def place_of(c: Chunk) -> Place:
    if c.state is DEVICE:
        return Place.DEVICE
    if c.state is LAYERED:
        return Place.LAYERED
    if c.state is DROPPED:
        return Place.DROPPED
    if c.shadow is not None:
        return Place.CACHED
    return Place.HOST if c.state is HOST else Place.LOWER


def places_of(s: Session, chunks: int | None = None) -> tuple[Place, ...]:
    """The places of the first `chunks` chunks of `s` (None: all of them)."""
    return tuple(place_of(c) for c in (s.chunks if chunks is None else s.chunks[:chunks]))


def check_factor(factor: int, num_layers: int) -> int:
    """A keep factor: 0 (no layer on the device), 1 (all layers) or 2..num_layers."""
    if isinstance(factor, bool) or not isinstance(factor, int) or not 0 <= factor <= num_layers:
        raise ValueError(f"keep factor must be an int in [0, {num_layers}] (0: no layer on the device, 1: all, "
                         f"f: layers l with l % f == r), got {factor!r}")
    return factor


def blocks_at_most(factor: int, chunks: int) -> int:
    """Device blocks `chunks` new chunks of keep factor `factor` take at most: all (1), none (0),
    ceil(chunks / f) residue blocks (f >= 2; fewer when open residue blocks have free residues).
    A bound that holds whatever else a step takes: what a scheduler adds up over a step's entries."""
    if factor == 1:
        return chunks
    return 0 if factor == 0 else -(-chunks // factor)


class ChunkNeeds(NamedTuple):
    """Chunks below a step's last row, by what the step must do with them (chunk indices)."""

    fills: list[int]        # stored nowhere (dropped, or past the kept history): a fresh block each
    copies: list[int]       # in a lower tier (or only cached on the device): copied or rebuilt up
    in_place: list[int]     # HOST chunks a layer-wise entry (factor != 1) reads in place


def needs(places: Sequence[Place], end: int, length: int, factor: int, block_size: int) -> ChunkNeeds:
    """What a step whose rows reach position `end` - 1 must do with each chunk below it, for a history
    cut to `length` tokens (chunks past it count as fills) whose chunks are at `places` and whose
    dropped chunks are recomputed whole. The classification `entry_needs` applies at plan time,
    answered ahead of it."""
    bs = block_size
    have = min(blocks_for(length, bs), len(places))
    fills, copies, in_place = [], [], []
    for k in range(blocks_for(end, bs)):
        p = places[k] if k < have else Place.DROPPED
        if p is Place.DROPPED:
            fills.append(k)
        elif p in RESIDENT:
            continue
        elif factor != 1 and p is Place.HOST:
            in_place.append(k)
        else:
            copies.append(k)
    return ChunkNeeds(fills, copies, in_place)


def entry_needs(s: Session, ids: list[int], pos: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """Validate one step entry of `s` (ValueError: a bad entry); return (chunks the rows fill: need a
    fresh block, chunks to copy up). The classification of `needs` at factor 1, except that a stored
    chunk whose every token is among the rows is filled afresh too, and a dropped one that is not is
    an error (its positions must be among the rows: `missing_positions`)."""
    n, bs = len(s.token_ids), block_size
    if len(ids) != len(pos) or not ids:
        raise ValueError(f"session {s.session_id!r}: step needs >= 1 token and one position per token")
    new = [p for p in pos if p >= n]
    if new != list(range(n, n + len(new))) or min(pos) < 0 or len(set(pos)) != len(pos):
        raise ValueError(f"session {s.session_id!r}: new positions must continue the history at {n} without gaps")
    for p, t in zip(pos, ids):
        if p < n and s.token_ids[p] != t:
            raise ValueError(f"session {s.session_id!r}: recomputed token at {p} is {t}, "
                             f"history has {s.token_ids[p]}")
    rows, end = set(pos), max(pos) + 1
    fill, swap = [], []
    for k in range(blocks_for(end, bs)):
        place = place_of(s.chunks[k]) if k < len(s.chunks) else Place.DROPPED
        if place in RESIDENT:              # readable in place (LAYERED: layer by layer)
            continue
        if all(p in rows for p in range(k * bs, min((k + 1) * bs, n, end))):
            fill.append(k)                 # every stored token of it is recomputed: fresh block
        elif place is Place.DROPPED:
            raise ValueError(f"session {s.session_id!r}: chunk {k} is dropped; its positions must be "
                             "recomputed in the step (missing_positions)")
        else:
            swap.append(k)
    return fill, swap
