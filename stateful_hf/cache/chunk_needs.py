"""What a step does with each chunk below its last row: fill it (a fresh device block, the rows
compute its KV), copy it up (a lower tier, or only cached on the device), read it in place (DEVICE,
LAYERED; a HOST chunk for a layer-wise entry), or nothing. One classification, asked two ways:
`needs` ahead of a step (the engine scheduler's question, through `KVStore.chunk_needs` /
`blocks_needed`) and `entry_needs` when the step planner plans it (validating the entry).

A step entry's keep factor (`factors` of `plan_step`, `factor` here) says how many of its layers
stay on the device: 1 all (every store), 0 or f >= 2 some (layerwise_kv stores only, `layerwise/`).
`check_factor` validates one; `blocks_at_most` bounds the device blocks its fills take.

Pure functions of a session's chunk table: they read, never mutate. Called with the store lock held.
"""

from __future__ import annotations

from typing import NamedTuple

from .session import ChunkState, Session

DEVICE, DROPPED, HOST, LAYERED = ChunkState.DEVICE, ChunkState.DROPPED, ChunkState.HOST, ChunkState.LAYERED


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


def needs(s: Session, end: int, length: int, factor: int, block_size: int) -> ChunkNeeds:
    """What a step of `s` whose rows reach position `end` - 1 must do with each chunk below it, for a
    history cut to `length` tokens (chunks past it count as fills) whose dropped chunks are
    recomputed whole. The classification `entry_needs` applies at plan time, answered ahead of it."""
    bs, chunks = block_size, s.chunks
    have = -(-length // bs)
    fills, copies, in_place = [], [], []
    for k in range(-(-end // bs)):
        c = chunks[k] if k < have else None
        if c is None or c.state is DROPPED:
            fills.append(k)
        elif c.state is DEVICE or c.state is LAYERED:       # readable in place
            continue
        elif factor != 1 and c.state is HOST and c.shadow is None:
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
    for k in range(-(-end // bs)):
        state = s.chunks[k].state if k < len(s.chunks) else DROPPED
        if state is DEVICE or state is LAYERED:     # readable in place (LAYERED: layer by layer)
            continue
        if all(p in rows for p in range(k * bs, min((k + 1) * bs, n, end))):
            fill.append(k)                 # every stored token of it is recomputed: fresh block
        elif state is DROPPED:
            raise ValueError(f"session {s.session_id!r}: chunk {k} is dropped; its positions must be "
                             "recomputed in the step (missing_positions)")
        else:
            swap.append(k)
    return fill, swap
