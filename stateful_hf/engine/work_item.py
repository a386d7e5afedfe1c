"""`WorkItem`: one request's rows in one step, and how the next rows of a request are cut."""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request


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


def next_item(r: Request, budget: int, length: int, store) -> WorkItem | None:
    """The next rows of `r` within `budget` tokens: whole missing chunks first, their ids read from
    the session in `store` (a KVStore; read only); new ids only once nothing before them is missing.
    None if nothing fits."""
    block_size = store.block_size
    recompute: list[int] = []
    for k in sorted({p // block_size for p in r.missing}):
        chunk = [p for p in r.missing if p // block_size == k]
        if len(recompute) + len(chunk) > budget:
            break
        recompute += chunk
    new: list[int] = []
    if len(recompute) == len(r.missing):
        new = r.pending[: budget - len(recompute)]
    if not recompute and not new:
        return None
    history = store.session(r.session_id).token_ids if recompute else ()
    return WorkItem(r, tuple(recompute), tuple(history[p] for p in recompute), tuple(new), length,
                    needs_logits=bool(new) and len(new) == len(r.pending), factor=r.factor)


def whole_item(r: Request, keep: int) -> WorkItem:
    """All of r's remaining rows as one item at keep factor 0 (so host chunks count as in place)."""
    return WorkItem(r, tuple(r.missing), (), tuple(r.pending), keep, False, factor=0)


def item_end(item: WorkItem) -> int:
    """One past the item's last row position."""
    return max(item.start + len(item.new_ids), max(item.recompute, default=-1) + 1)


def blocks_needed(store, item: WorkItem, length: int | None = None) -> int:
    """Device blocks the store must give this item: chunks up to its last row that are not on the
    device (chunks past the history `length` are new or will be cut, so they count; None: the session's
    length). A layer-wise item (factor != 1) fills its chunks with residue blocks, ceil(n / f) blocks at
    most, and reads host chunks in place. Read only."""
    sid = item.request.session_id
    return store.blocks_needed(sid, item_end(item), length=store.session(sid).num_tokens if length is None
                               else length, factor=item.factor)


def chunk_needs(store, r: Request, item: WorkItem, length: int | None = None):
    """The store's ChunkNeeds of the item: (chunks it fills, copies up, reads in place). Read only."""
    return store.chunk_needs(r.session_id, item_end(item), length=store.session(r.session_id).num_tokens
                             if length is None else length, factor=item.factor)
