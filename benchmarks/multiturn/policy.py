"""LRU vs the cost-aware (Pensieve) policy under memory pressure, replayed on a virtual clock.

Which chunks a policy evicts depends on the sessions' idle times T and on Cost(l). Under concurrent
serving on a shared, noisy CPU both follow the wall clock, so two runs of one policy recompute
different amounts. Here the turns of a scheduled workload get times from a virtual clock
(conversation starts and think times from the schedule, each turn taking `per_token_s` per prompt
and output token), are served one at a time in that order, and the store is given the same virtual
clock (`SessionStore(clock=...)`): the eviction order then depends only on the policy and the Cost
profile, and the store counts the tokens it had to recompute.

The replay's conversations use the dataset's real lengths (Pensieve's statistics, unscaled), where
Cost(l) differs between leading and trailing chunks; the main runs' lengths are scaled down for this
CPU, and at those lengths Cost(l) is flat and the two policies rank chunks alike. Recomputed token
counts depend only on which chunks were dropped, not on what the model computes, so the replay runs
a small model for speed, with the Cost profile measured on the benchmark's model.
"""

from __future__ import annotations

import heapq
import time

import torch

import stateful_hf
from stateful_hf.cache import CostProfile, LRUPolicy, RetentionPolicy

from .workload import Workload

POLICIES = {"stateful_hf": RetentionPolicy, "stateful_hf_lru": lambda profile: LRUPolicy()}


def virtual_order(wl: Workload, per_token_s: float = 0.02) -> list[tuple[float, int, int]]:
    """(virtual arrival time, conversation index, turn index) of every turn, in arrival order: a
    turn arrives when its previous one has finished (per_token_s per token) plus its think time."""
    heap = [(c.start_s, i, 0) for i, c in enumerate(wl.conversations)]
    heapq.heapify(heap)
    order = []
    while heap:
        t, i, k = heapq.heappop(heap)
        order.append((t, i, k))
        turns = wl.conversations[i].turns
        if k + 1 < len(turns):
            done = t + per_token_s * (len(turns[k].user_ids) + turns[k].output_len)
            heapq.heappush(heap, (done + turns[k].think_s, i, k + 1))
    return order


@torch.inference_mode()
def replay(model, wl: Workload, order: list[tuple[float, int, int]], budget: int, policy,
           profile: CostProfile, chunk: int = 32) -> dict:
    """Serve the turns one at a time in `order` through `model.generate` over a store of `budget`
    device tokens whose clock is the virtual one. Returns the store's token counts, the modeled
    recompute cost (sum of Cost(l) over the dropped chunks each returning turn finds, l = 32 (k + 1)
    for chunk k: what Pensieve's policy minimizes) and the generated tokens."""
    now = [0.0]
    store = stateful_hf.SessionStore(model, budget, chunk_size=chunk, policy=policy, cost_profile=profile,
                                     clock=lambda: now[0])
    history: dict[int, list[int]] = {}
    outputs, cost, t0 = {}, 0.0, time.monotonic()
    for t, i, k in order:
        now[0] = t
        c = wl.conversations[i]
        if c.conv_id in store:
            cost += sum(profile.cost(chunk * (j + 1)) for j, x in enumerate(store.session(c.conv_id).chunks)
                        if x.state.name == "DROPPED")
        ids = torch.tensor([history.get(i, []) + list(c.turns[k].user_ids)])
        n = c.turns[k].output_len
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=store.cache(c.conv_id),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        outputs[(c.conv_id, k)] = out[0, ids.shape[1]:].tolist()
        history[i] = out[0].tolist()
    store.check_integrity()
    counters = store.counters
    return {"recomputed_tokens": counters.recomputed, "dropped_tokens": counters.dropped,
            "device_hits": counters.device_hits, "hit_rate": store.stats().hit_rate,
            "modeled_recompute_cost_s": cost, "seconds": time.monotonic() - t0, "turns": len(order),
            "outputs": outputs}


def compare(model, wl: Workload, budget: int, profile: CostProfile, chunk: int = 32,
            log=print) -> dict:
    """Both policies on the same virtual-clock replay of `wl` at `budget` device tokens. `outputs`
    ((conv_id, turn) -> generated ids, not JSON-ready) are the cost-aware run's."""
    order = virtual_order(wl)
    res = {}
    for name, make in POLICIES.items():
        res[name] = replay(model, wl, order, budget, make(profile), profile, chunk)
        log(f"  policy replay {name}: recomputed {res[name]['recomputed_tokens']} tokens, modeled cost "
            f"{res[name]['modeled_recompute_cost_s']:.3f} s ({res[name]['seconds']:.1f} s)")
    a, b = res["stateful_hf"]["recomputed_tokens"], res["stateful_hf_lru"]["recomputed_tokens"]
    outputs = res["stateful_hf"].pop("outputs")
    same = outputs == res["stateful_hf_lru"].pop("outputs")
    return {"outputs": outputs, "budget_tokens": budget, "turns": len(order), "replay": "serial, virtual clock",
            "workload": wl.describe(), "systems": res, "cost_aware_recomputed": a, "lru_recomputed": b,
            "cost_aware_fewer_recomputed": a < b, "reduction": (b - a) / b if b else 0.0, "same_tokens": same,
            "cost_profile": {"lengths": list(profile.lengths), "seconds": list(profile.seconds)}}
