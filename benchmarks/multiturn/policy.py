"""LRU vs the cost-aware (Pensieve) policy under memory pressure, replayed deterministically.

Under concurrent serving on a shared, noisy CPU, which chunks get evicted depends on timing, so two
runs of the same policy recompute different amounts. Here the turns of the scheduled workload are
put in the order a virtual clock gives (conversation starts and think times from the schedule, each
turn taking `per_token_s` per prompt-plus-output token), then served one at a time through the engine
at the given device budget. The eviction order then depends only on the policy; the store counts the
tokens it had to recompute."""

from __future__ import annotations

import heapq
import time

from .workload import Workload


def virtual_order(wl: Workload, per_token_s: float = 0.02) -> list[tuple[int, int]]:
    """(conversation index, turn index) in the order the turns would arrive on a virtual clock."""
    heap = [(c.start_s, i, 0) for i, c in enumerate(wl.conversations)]
    heapq.heapify(heap)
    order = []
    while heap:
        t, i, k = heapq.heappop(heap)
        order.append((i, k))
        turns = wl.conversations[i].turns
        ctx = sum(len(x.user_ids) + x.output_len for x in turns[:k + 1])
        if k + 1 < len(turns):
            heapq.heappush(heap, (t + per_token_s * ctx + turns[k].think_s, i, k + 1))
    return order


def dropped_chunks(store, session_id: str) -> list[int]:
    """Chunk indices of the session whose KV is dropped (only token ids kept): a turn recomputes them."""
    if session_id not in store:
        return []
    return [k for k, c in enumerate(store.session(session_id).chunks) if c.state.name == "DROPPED"]


def replay(system, wl: Workload, order: list[tuple[int, int]], profile=None) -> dict:
    """Serve the turns one at a time in `order`; returns the store's token counts and the tokens.
    With a CostProfile, also the modeled recompute cost: sum of Cost(l) over the dropped chunks each
    returning turn finds (l = 32 * (k + 1) for chunk k), the quantity Pensieve's policy minimizes."""
    history: dict[int, list[int]] = {}
    outputs = {}
    cost = 0.0
    system.start()
    t0 = time.monotonic()
    try:
        for i, k in order:
            c = wl.conversations[i]
            ids = history.get(i, []) + list(c.turns[k].user_ids)
            if profile is not None:
                bs = system.store.block_size
                cost += sum(profile.cost(bs * (j + 1)) for j in dropped_chunks(system.store, c.conv_id))
            r = system.run_turn(c.conv_id, ids, c.turns[k].output_len)
            outputs[(c.conv_id, k)] = r.tokens
            history[i] = ids + r.tokens
    finally:
        system.stop()
    info = system.info()
    counters = info["store_counters"]
    return {"recomputed_tokens": info["recomputed_tokens"], "dropped_tokens": counters["dropped"],
            "device_hits": counters["device_hits"], "hit_rate": info["hit_rate"],
            "modeled_recompute_cost_s": cost, "seconds": time.monotonic() - t0, "turns": len(order),
            "outputs": outputs}
