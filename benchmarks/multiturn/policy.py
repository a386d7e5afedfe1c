"""Eviction policies under memory pressure, replayed on a virtual clock: the store's default, the
return-aware expected cost, Pensieve's original, LRU, and an offline oracle.

Which chunks a policy evicts depends on the sessions' idle times T and on Cost(l). Under concurrent
serving on a shared, noisy CPU both follow the wall clock, so two runs of one policy recompute
different amounts. Here the turns of a scheduled workload get times from a virtual clock
(conversation starts and think times from the schedule, each turn taking `per_token_s` per prompt
and output token), are served one at a time in that order, and the store is given the same virtual
clock (`SessionStore(clock=...)`): the eviction order then depends only on the policy and the Cost
profile (pass a fixed one to make runs identical), and the store counts the tokens it had to recompute.

The replay's conversations use the dataset's real lengths (Pensieve's statistics, unscaled), where
Cost(l) differs between leading and trailing chunks; the main runs' lengths are scaled down for this
CPU, and at those lengths Cost(l) is flat and the policies rank chunks alike. Recomputed token
counts depend only on which chunks were dropped, not on what the model computes, so the replay runs
a small model for speed, with the Cost profile measured on the benchmark's model. Conversations end
without telling the server; the store's policies cannot know which idle ones are finished. The
oracle can: it reads the schedule (Belady: the conversation whose next turn is furthest away, or
that has none, goes first), a reference for how much any online policy could save, not a policy.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import time

import torch

import stateful_hf
from stateful_hf.cache import DEFAULT_POLICY, CostProfile, EvictionPolicy, KVSpec, KVStore, make_policy
from stateful_hf.testing import VOCAB_SIZE

from .arrivals import Arrivals, schedule
from .workload import Workload, load_sharegpt, synthesize

# name in the results -> policy over a Cost profile; "stateful_hf" is the store's default policy
POLICIES = {
    "stateful_hf": lambda profile: make_policy(DEFAULT_POLICY, profile),
    "stateful_hf_return_aware": lambda profile: make_policy("return_aware", profile),
    "stateful_hf_pensieve": lambda profile: make_policy("pensieve", profile),
    "stateful_hf_lru": lambda profile: make_policy("lru"),
}
ORACLE = "oracle"


def replay_workload(conversations: int, think_s: float = 30.0, rate: float = 0.2, seed: int = 0,
                    dataset: str = "sharegpt", scale: float = 1.0, data: str | None = None) -> Workload:
    """The replay's scheduled workload, as `python -m benchmarks.multiturn` builds it for --seed
    (conversations drawn with seed + 1, up to 16 turns of at most 1024 tokens each)."""
    if data:
        wl = load_sharegpt(data, conversations, scale, 16, 1024, 1024, VOCAB_SIZE)
    else:
        wl = synthesize(conversations, dataset, scale, 16, 1024, 1024, VOCAB_SIZE, seed + 1)
    return schedule(wl, Arrivals(rate=rate, think_s=think_s, seed=seed + 1))


def load_cost_profile(path: str) -> CostProfile:
    """A Cost profile from JSON: {"lengths", "seconds"}, or a results file holding policy.cost_profile."""
    with open(path) as f:
        d = json.load(f)
    d = d.get("policy", d).get("cost_profile", d)
    return CostProfile(tuple(d["lengths"]), tuple(d["seconds"]))


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


class OraclePolicy(EvictionPolicy):
    """Offline reference, not a policy a server can run: it knows every turn's virtual arrival. The
    conversation whose next turn is furthest away goes first (those with none left first of all),
    inside it the cheapest Cost(s, l) first (Belady's rule; its chunks are all needed at that turn)."""

    name = ORACLE

    def __init__(self, wl: Workload, order: list[tuple[float, int, int]], profile: CostProfile):
        self.profile = profile
        self.arrivals: dict[str, list[float]] = {}
        for t, i, _ in order:
            self.arrivals.setdefault(wl.conversations[i].conv_id, []).append(t)

    def key(self, session, k, block_size, now):
        times = self.arrivals.get(session.session_id, [])
        j = bisect.bisect_right(times, now)
        nxt = times[j] if j < len(times) else math.inf
        cost = self.profile.chunk_cost(k, session.chunk_len(k, block_size), block_size)
        return (-nxt, session.session_id, cost, k)


def _dropped_cost(profile: CostProfile, session, chunk: int) -> float:
    """Modeled cost of recomputing a session's dropped chunks: the sum of their Cost(s, l)."""
    return sum(profile.chunk_cost(j, session.chunk_len(j, chunk), chunk) for j, x in enumerate(session.chunks)
               if x.state.name == "DROPPED")


def _counts(store, cost: float, t0: float, turns: int) -> dict:
    """A finished replay's figures (the store's invariants are checked first)."""
    store.check_integrity()
    counters = store.counters
    return {"policy": store.policy.name, "recomputed_tokens": counters.recomputed, "dropped_tokens": counters.dropped,
            "device_hits": counters.device_hits, "hit_rate": store.stats().hit_rate,
            "modeled_recompute_cost_s": cost, "seconds": time.monotonic() - t0, "turns": turns}


@torch.inference_mode()
def replay(model, wl: Workload, order: list[tuple[float, int, int]], budget: int, policy,
           profile: CostProfile, chunk: int = 32) -> dict:
    """Serve the turns one at a time in `order` through `model.generate` over a store of `budget`
    device tokens whose clock is the virtual one. Returns the store's token counts, the modeled
    recompute cost (sum of Cost(s, l) over the dropped chunks each returning turn finds: what the
    cost-aware policies minimize) and the generated tokens. The store's invariants are checked."""
    now = [0.0]
    store = stateful_hf.SessionStore(model, budget, chunk_size=chunk, policy=policy, cost_profile=profile,
                                     clock=lambda: now[0])
    history: dict[int, list[int]] = {}
    outputs, cost, t0 = {}, 0.0, time.monotonic()
    for t, i, k in order:
        now[0] = t
        c = wl.conversations[i]
        if c.conv_id in store:
            cost += _dropped_cost(profile, store.session(c.conv_id), chunk)
        ids = torch.tensor([history.get(i, []) + list(c.turns[k].user_ids)])
        n = c.turns[k].output_len
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=store.cache(c.conv_id),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        outputs[(c.conv_id, k)] = out[0, ids.shape[1]:].tolist()
        history[i] = out[0].tolist()
    return {**_counts(store, cost, t0, len(order)), "outputs": outputs}


def replay_counts(wl: Workload, order: list[tuple[float, int, int]], budget: int, policy, profile: CostProfile,
                  chunk: int = 32) -> dict:
    """`replay` without a model, in seconds instead of minutes: the same store calls that `generate`
    with a StatefulCache makes per turn (lease; recompute the dropped history in one step; the new
    tokens in one step; one step per generated token but the last), on a store of the same block
    count, with placeholder token ids. The counts are `replay`'s (tests/test_multiturn_bench.py
    checks it); there are no outputs to compare."""
    now = [0.0]
    store = KVStore(KVSpec(1, 1, 1, block_size=chunk), budget, policy=policy, clock=lambda: now[0])
    cost, t0 = 0.0, time.monotonic()
    for t, i, k in order:
        now[0] = t
        c, sid = wl.conversations[i], wl.conversations[i].conv_id
        s = store.open(sid)
        cost += _dropped_cost(profile, s, chunk)
        new = ([0] if s.token_ids else []) + list(c.turns[k].user_ids)     # the last answer's last token first
        with store.lease(sid):
            missing = store.missing_positions(sid)
            if missing:
                store.commit(store.plan_step([(sid, [s.token_ids[p] for p in missing], missing)]))
            for ids in [new] + [[0]] * (c.turns[k].output_len - 1):
                store.commit(store.plan_step([(sid, ids, range(s.num_tokens, s.num_tokens + len(ids)))]))
    return _counts(store, cost, t0, len(order))


def compare(model, wl: Workload, budget: int, profile: CostProfile, chunk: int = 32, oracle: bool = True,
            log=print) -> dict:
    """Every policy of POLICIES (and the oracle) on the same virtual-clock replay of `wl` at `budget`
    device tokens. `cost_aware_*` refer to the store's default policy ("stateful_hf"); `outputs`
    ((conv_id, turn) -> generated ids, not JSON-ready) are its run's; `same_tokens`: every run
    generated exactly those. `model` None: `replay_counts` (no outputs; `same_tokens` None)."""
    order = virtual_order(wl)
    makers = dict(POLICIES)
    if oracle:
        makers[ORACLE] = lambda p: OraclePolicy(wl, order, p)
    res = {}
    for name, make in makers.items():
        res[name] = replay(model, wl, order, budget, make(profile), profile, chunk) if model is not None else \
            {**replay_counts(wl, order, budget, make(profile), profile, chunk), "outputs": None}
        log(f"  policy replay {name} ({res[name]['policy']}): recomputed {res[name]['recomputed_tokens']} tokens, "
            f"modeled cost {res[name]['modeled_recompute_cost_s']:.3f} s ({res[name]['seconds']:.1f} s)")
    outputs = res["stateful_hf"]["outputs"]
    same = all([r.pop("outputs") == outputs for r in res.values()]) if model is not None else None   # pop all
    n = {name: r["recomputed_tokens"] for name, r in res.items()}
    a, b = n["stateful_hf"], n["stateful_hf_lru"]
    return {"outputs": outputs, "budget_tokens": budget, "turns": len(order), "replay": "serial, virtual clock",
            "workload": wl.describe(), "systems": res, "default_policy": DEFAULT_POLICY,
            "cost_aware_recomputed": a, "lru_recomputed": b, "pensieve_recomputed": n["stateful_hf_pensieve"],
            "return_aware_recomputed": n["stateful_hf_return_aware"], "oracle_recomputed": n.get(ORACLE),
            "cost_aware_fewer_recomputed": a < b, "reduction": (b - a) / b if b else 0.0, "same_tokens": same,
            "cost_profile": {"lengths": list(profile.lengths), "seconds": list(profile.seconds)}}
