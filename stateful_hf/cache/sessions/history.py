"""History: sessions' token ids as callers edit them — a turn's start (adopt a shared prefix, cut a
divergent tail, prove disk chunks, count), truncation, deletion — and which positions are missing.

Collaborators: the session table, the pools (`release`), prefix sharing (through the pools:
`adopt`, `privatize`, `retainable`, `findable`, holders), the disk state (`cut`), placement (`prove`,
`drop`), the step planner (`begin_turn`, the one writer of `last_turn`).
Mutates: sessions' token ids and chunk tables (a cut releases the chunks past it; slots go back only
through `TierPools.release`), `Session.retained`, the table's map (`delete`). Never syncs the disk
index: the facade does after each call. Every method runs with the store lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...kernels.blocks import blocks_for
from ..errors import SessionBusyError, StoreError
from ..movement.placement import Placement
from ..pools.tier_pools import TierPools
from ..prefix.index import PrefixScope
from ..step_planner import StepPlanner
from ..turn import Place, Room, TurnNeeds, places_of
from .session import ON_DISK, ChunkState, Session, SessionTable, TurnStats
from .tenant import TenantUsage, tenant_of

if TYPE_CHECKING:
    from ..disk.state import DiskState
    from ..feature import NoDisk

DROPPED = ChunkState.DROPPED


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

log = logging.getLogger("stateful_hf.store")


def kept_prefix(history: Sequence[int], prompt: Sequence[int]) -> int:
    """The keep rule: the history tokens a turn whose prompt is `prompt` keeps, their common prefix,
    at least one token short of the prompt (the turn's last prompt row computes the logits)."""
    return max(min(common_prefix(history, prompt), len(prompt) - 1), 0)


class History:
    def __init__(self, sessions: SessionTable, tiers: TierPools, placement: Placement, disk_state: DiskState | NoDisk,
                 planner: StepPlanner):
        self.sessions, self.tiers, self.placement, self.disk_state = sessions, tiers, placement, disk_state
        self.sharing, self.planner, self.block_size = tiers.sharing, planner, tiers.device.spec.block_size

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Per tenant: sessions, history tokens, tokens stored in some tier (retained prefixes are not
        sessions). From the table's counts: O(tenants + sessions changed since the last read)."""
        acc = {t: [n, 0, 0] for t, n in self.sessions.live_sessions_per_tenant().items()}
        for (state, t), n in self.sessions.live_usage().items():
            a = acc.setdefault(t, [0, 0, 0])
            a[1] += n
            a[2] += 0 if state is DROPPED else n
        return {t: TenantUsage(*a) for t, a in acc.items()}

    def delete(self, s: Session, keep_shared: bool) -> None:
        """`KVStore.delete`: forget the session and free what only it holds. `keep_shared` (the engine's throwaway
        sessions): if it alone holds indexed chunks of a shared prefix, they stay in the store, held
        by the session, now `retained` (its id is no longer listed), until the policy drops them or
        a turn uses its id again (`_revive`), so that the next turn with that prefix reuses them
        (prefix/sharing.py)."""
        if s.busy:
            raise SessionBusyError(s.session_id)
        keep = self.sharing.retainable(s) if keep_shared else 0
        if keep:
            self.truncate(s, keep * self.block_size)
            self.sessions.retain(s, True)
            return
        for k in range(len(s.chunks)):
            self.tiers.release(s, k)
        self.sessions.remove(s.session_id)

    def forget_idle(self, max_sessions: int | None, ttl: float | None) -> int:
        """Forget idle sessions whole, least recently released first, while more than `max_sessions`
        are held or the oldest was last active more than `ttl` seconds ago: what only they hold is
        freed, what they share with others stays theirs (`delete`). O(sessions forgotten). Counts
        `forgotten_sessions`."""
        if max_sessions is None and ttl is None:
            return 0
        n, now = 0, self.sessions.clock()
        while (s := self.sessions.oldest_idle()) is not None:
            if not ((max_sessions is not None and self.sessions.live > max_sessions)
                    or (ttl is not None and now - s.last_active > ttl)):
                break
            self.delete(s, keep_shared=False)
            n += 1
        if n:
            self.placement.counters.forgotten_sessions += n
            log.info("forgot %d idle sessions (max_sessions=%s, session_ttl=%s); %d held", n, max_sessions, ttl,
                     self.sessions.live)
        return n

    def collect_retained(self) -> None:
        """Retained sessions none of whose chunks can be found any more are deleted."""
        for s in [s for s in self.sessions.retained() if not s.busy and not self.sharing.findable(s)]:
            self.delete(s, keep_shared=False)

    def adopt(self, s: Session, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """`KVStore.turn_needs` of an idle session: before a turn whose prompt is `token_ids` (the engine's scheduler,
        to size the turn before its lease; `begin_turn` does it too): idle `s` takes the indexed chunks
        of the longest shared prefix of the prompt (its tenant's and `cache_salt`'s, verified id by id,
        at least one token short of the prompt) in place of its dropped chunks and past its history, if
        its history is a prefix of the prompt. Returns the tokens it gained (`prefix/sharing.py`).
        ValueError: a `cache_salt` other than the one the session was opened with."""
        if s.busy:
            raise SessionBusyError(s.session_id)
        self._revive(s, cache_salt)
        got = self.sharing.adopt(s, token_ids, cache_salt, self.tiers.release)
        if got:                                 # a shared chunk it took may be on the device
            self.sessions.mark(s.session_id)
        return got

    def _revive(self, s: Session, cache_salt: str | None) -> None:
        """A turn on the id of a retained session (deleted with `keep_shared`, then used again, e.g. a
        throwaway key a caller submits with once more) starts a session: it is listed and counted
        again and never collected. Its kept prefix is reused where the prompt matches it; under
        another `cache_salt` it is cut to nothing first (the deleted session's scope is not this one's).
        Mutates: `s.retained`, and the history of `s` (`truncate`) when the scope differs."""
        if not s.retained:
            return
        self.sessions.retain(s, False)
        if s.scope is not None and s.scope != PrefixScope(tenant_of(s.session_id), cache_salt):
            self.truncate(s, 0)

    def begin_turn(self, s: Session, prompt: Sequence[int], cache_salt: str | None,
                   expect_keep: int | None = None) -> TurnStats:
        """`KVStore.begin_turn`: a turn of the leased session starts with `prompt` (the whole conversation's ids): it
        adopts the shared chunks of the prompt's prefix (`adopt_prefix`, scoped by its tenant and
        `cache_salt`), its history is cut to the longest common prefix (at least one token short of
        the prompt, so the turn computes logits), its disk chunks are proven, and its `last_turn`
        restarts with what each tier holds for it (reused_device / swapped_in_host / swapped_in_disk /
        restored_hidden). `expect_keep`: StoreError, before any change but the adoption, if the
        turn keeps another length. Every step committed during the lease adds its rows (computed_tokens,
        recomputed_tokens); `add_generated` sets generated_tokens. The store is the one writer of last_turn."""
        if not s.busy:
            raise StoreError(f"begin_turn: session {s.session_id!r} is not leased (use store.lease first)")
        self._revive(s, cache_salt)
        self.sharing.adopt(s, prompt, cache_salt, self.tiers.release)
        keep = kept_prefix(s.token_ids, prompt)
        if expect_keep is not None and keep != expect_keep:
            raise StoreError(f"session {s.session_id!r}: the turn keeps {keep} tokens, not the {expect_keep} "
                             "asked about (the session changed since turn_needs)")
        truncated = self.truncate(s, keep)
        self.placement.prove(s)
        self.sessions.recount(s.session_id)
        return self.planner.begin_turn(s, truncated)

    def truncate(self, s: Session, length: int) -> int:
        """Cut the history of `s` to its first `length` tokens; returns how many were cut. A cut inside
        a chunk others share makes it the session's private copy where it is on the device and a block
        is free (`Placement.copy_on_write`), else releases it (a shared chunk is immutable: its kept
        tokens are recomputed); a cut inside a disk chunk retags it, or drops it if it fails its checksum."""
        if length < 0:
            raise ValueError(f"cannot truncate to {length} tokens")
        bs = self.block_size
        cut = max(len(s.token_ids) - length, 0)
        if not cut:
            return 0
        self.sessions.recount(s.session_id)
        keep = blocks_for(length, bs)
        for k in range(keep, len(s.chunks)):
            self.tiers.release(s, k)
        del s.chunks[keep:]
        if length % bs and not self.sharing.privatize(s, keep - 1) \
                and not self.placement.copy_on_write(s, keep - 1, length % bs):
            self.tiers.release(s, keep - 1)
        cut_inside = bool(s.chunks) and s.chunks[-1].state in ON_DISK and length % bs
        old_ids = s.token_ids[: keep * bs] if cut_inside else None
        del s.token_ids[length:]
        # its checksum named the longer prefix: retag it, or drop it if it does not hold what it should
        if cut_inside and not self.disk_state.cut(s, keep - 1, old_ids):
            self.placement.drop(s, keep - 1)
        return cut

    def missing_positions(self, s: Session, cut: int | None) -> list[int]:
        """`KVStore.missing_positions`: history positions whose KV is stored nowhere (DROPPED): a
        step must recompute them. Host and disk chunks are not missing: `plan_step` copies them up
        (disk chunks are proven first: those that fail are missing). `cut`: as they will be after
        `truncate(session_id, cut)` (positions < cut only), at the most: a cut inside a chunk other
        sessions share counts its kept positions too (the cut may still copy it on write and keep
        them: ask again after it, as the engine's admission does)."""
        bs = self.block_size
        self.placement.prove(s)        # disk chunks that are not what they name are missing too
        out = [p for k, c in enumerate(s.chunks) if c.state is DROPPED for p in s.chunk_range(k, bs)]
        if cut is None:
            return out
        k = cut // bs
        if cut < s.num_tokens and cut % bs and s.chunks[k].state is not DROPPED \
                and s.chunks[k].entry is not None and s.chunks[k].entry.holders != {s.session_id}:
            out = sorted(set(out) | set(range(k * bs, cut)))
        return [p for p in out if p < cut]

    def turn_needs(self, s: Session, prompt: Sequence[int] | None, room: Room, has_slot: bool | None) -> TurnNeeds:
        """`KVStore.turn_needs`: what a turn of `s` with `prompt` would take, after the cut to the kept
        prefix (None: the leased turn continuing, keeping the whole history). Proves disk chunks."""
        if s.busy and prompt is not None:
            return TurnNeeds(s.session_id, True, 0, (), (), (), has_slot, self.block_size, room)
        keep = s.num_tokens if prompt is None else kept_prefix(s.token_ids, prompt)
        missing = tuple(self.missing_positions(s, None if prompt is None else keep))
        bs, ids = self.block_size, s.token_ids
        dropped = {p // bs for p in missing}       # also a cut shared chunk: the session lets go of it
        places = tuple(Place.DROPPED if k in dropped else p for k, p in enumerate(places_of(s, blocks_for(keep, bs))))
        return TurnNeeds(s.session_id, False, keep, missing, tuple(ids[p] for p in missing), places, has_slot,
                         bs, room)
