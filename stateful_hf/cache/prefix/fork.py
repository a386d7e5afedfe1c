"""A session forked from another (`KVStore.fork`): OpenAI's `n` choices of one prompt, each going on
from the same KV.

The new session's history is the first `length` tokens of the parent's (its common prefix with the
caller's ids). Its full chunks are the parent's, shared (`PrefixSharing.fork`: one chunk object in
both tables, refcounted by the entry's holders, immutable); its partial last chunk (1 to
`block_size - 1` tokens) is a copy in a new device block (`Transfer.duplicate`, with the block's
captured hidden states), so the two append to their own blocks and neither sees the other's rows.
A chunk with no KV to give (dropped, a hidden rebuild in flight, a partial chunk not on the device,
or no device block to be had) is a DROPPED chunk of the child: its next turn recomputes it, or
adopts it from the prefix index. The parent may be busy: a step of it planned and not committed is
left out (the tokens it appends, the chunks it fills), so only committed K/V is shared or copied.

With `replace` an existing session of the new id is deleted first, in the same hold of the store lock
(continuing a held choice: the chosen fork's history and KV become the session's, its partial chunk a
copy), so no reader sees the id missing or half made; every check comes before that delete.

Needs prefix sharing (a paged layout without layer-wise KV, `prefix_sharing` not off): otherwise
StoreError, and the caller runs the turn without a fork. Runs with the store lock held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import CapacityError, SessionBusyError, StoreError
from ..sessions.history import common_prefix
from ..sessions.session import Chunk, ChunkState, Session
from ..sessions.tenant import tenant_of

if TYPE_CHECKING:
    from ..store_parts import StoreParts

DEVICE = ChunkState.DEVICE


def fork_session(p: StoreParts, parent: Session, child_id: str, token_ids: Sequence[int] | None,
                 replace: bool = False) -> int:
    """`KVStore.fork`: the new session `child_id`; returns the tokens whose KV it got (shared or copied).
    `replace`: an existing `child_id` (not busy, not the parent) is deleted first (module docstring).
    Mutates: the session table (the child), the parent's private full chunks (shared now), a device block."""
    if not p.sharing.enabled:
        raise StoreError("fork shares the parent's full chunks: this store has prefix sharing off "
                         "(prefix_sharing=False, a virtual layout or layerwise_kv)")
    if tenant_of(child_id) != tenant_of(parent.session_id):
        raise ValueError(f"session {child_id!r} is another tenant's than {parent.session_id!r}: a fork stays in its "
                         "tenant")
    old = p.sessions.find(child_id)
    if old is not None and not replace:
        raise StoreError(f"session {child_id!r} exists; a fork makes a new session")
    if old is parent:
        raise ValueError(f"session {child_id!r} cannot replace itself with a fork of itself")
    if old is not None and old.busy:
        raise SessionBusyError(child_id)
    if old is not None:
        p.history.delete(old, keep_shared=False)
    flight = p.planner.in_flight.get(parent.session_id)       # a step of the parent in flight: left out
    length = parent.num_tokens if flight is None else flight.old_len
    if token_ids is not None:
        length = min(length, common_prefix(parent.token_ids, token_ids))
    bs, skip = p.tiers.device.spec.block_size, set(flight.new_blocks) if flight is not None else set()
    child = p.sessions.open(child_id)
    try:
        got = p.sharing.fork(parent, child, length // bs, skip) * bs
        if length % bs:
            k = length // bs
            block = _copy(p, parent, k, skip, {parent.session_id, child_id})
            child.token_ids.extend(parent.token_ids[k * bs:length])
            child.chunks.append(Chunk() if block is None else Chunk(DEVICE, block))
            got += 0 if block is None else length % bs
    except BaseException:
        p.history.delete(child, keep_shared=False)
        raise
    p.sessions.mark(child_id)
    return got


def _copy(p: StoreParts, parent: Session, k: int, skip: set[int], exclude: set[str]) -> int | None:
    """A new device block holding chunk k of `parent` (its K/V and captured hidden states), or None: the
    chunk is not on the device, is being filled or rebuilt, or no block can be had now."""
    c, pool = parent.chunks[k], p.tiers.device
    if c.state is not DEVICE or c.source is not None or k in skip or pool.virtual:
        return None
    try:
        [block] = p.placement.take(DEVICE, 1, exclude)
    except CapacityError:
        return None
    p.transfer.duplicate(pool, c.loc, block)
    p.hidden.copy_block(c.loc, block)
    return block
