"""One benchmark run: build the systems on one model and one KV budget, drive each through the same
scheduled workload, collect the figures."""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import stateful_hf
from stateful_hf.cache import CostProfile
from stateful_hf.profile.cost import measure_cost_profile
from stateful_hf.testing import tiny_llama

from . import driver, metrics, policy
from .arrivals import Arrivals, schedule
from .systems import HFContinuousBatching, StatefulEngine, Stateless, store_options
from .workload import Workload

ALL_SYSTEMS = ("hf_stateless", "hf_continuous_batching", "stateful_hf", "stateful_hf_host", "stateful_hf_disk",
               "stateful_hf_hidden", "stateful_hf_lru", "stateful_hf_unshared")
# --system-prompt: sharing on and off, against transformers' CB with block sharing
SHARING_SYSTEMS = ("hf_continuous_batching", "stateful_hf", "stateful_hf_unshared")


@dataclass(slots=True)
class Config:
    budget_tokens: int                   # device KV budget, the same for every system
    max_batch_tokens: int = 256
    max_seqs: int = 64
    host_factor: float = 4.0             # host / disk tiers of the variants: this many times the budget
    chunk: int = 32
    profile_repeats: int = 3             # timing repeats of the Cost(l) and HCache profiles (median)


def budget_for(wl: Workload, fraction: float, chunk: int = 32) -> int:
    """`fraction` of the KV all conversations would hold at their end, but at least room for the two
    longest conversations plus a chunk each (so any single turn fits), in whole chunks."""
    ctx = sorted((c.max_context for c in wl.conversations), reverse=True)
    need = sum(-(-n // chunk) + 1 for n in ctx[:2]) * chunk
    want = int(fraction * sum(ctx))
    return max(need, -(-want // chunk) * chunk)


def policy_budget_for(wl: Workload, fraction: float = 0.3, chunk: int = 32) -> int:
    """For the serial policy replay: `fraction` of the total KV, at least the longest conversation
    plus two chunks (one turn at a time is served)."""
    need = (-(-max(c.max_context for c in wl.conversations) // chunk) + 2) * chunk
    return max(need, -(-int(fraction * sum(c.max_context for c in wl.conversations)) // chunk) * chunk)


class Bench:
    def __init__(self, model, cfg: Config, progress: bool = True, cost_profile: CostProfile | None = None):
        self.model, self.cfg, self.progress = model, cfg, progress
        self.cb_model = copy.deepcopy(model)     # CB swaps the attention implementation of its model
        self.tmp = tempfile.TemporaryDirectory(prefix="multiturn-disk-")
        self.fixed_profile = cost_profile
        self.profile = self.hcosts = None
        self.skipped: dict[str, str] = {}

    def cost_profile(self, max_context: int):
        """Pensieve's Cost(l) of the benchmark's model, measured up to `max_context` (once per range:
        measure_cost_profile keeps the longest profile measured so far), or the fixed one given."""
        if self.fixed_profile is not None:
            return self.fixed_profile
        limit = 64
        while limit < max_context:
            limit *= 2
        if self.profile is None or self.profile.lengths[-1] < limit:
            spec = stateful_hf.SessionStore(self.model, self.cfg.chunk * 2, policy="lru").spec
            self.profile = measure_cost_profile(self.model, spec, max_length=limit, repeats=self.cfg.profile_repeats)
        return self.profile

    def hidden_costs(self, max_context: int):
        """HCache's per-layer profile, measured once over the longest context used (whole chunks)."""
        if self.hcosts is None:
            from stateful_hf.profile.hidden import measure_hidden_costs
            store = stateful_hf.SessionStore(self.model, self.cfg.chunk * 2, policy="lru")
            tokens = -(-max_context // self.cfg.chunk) * self.cfg.chunk
            self.hcosts = measure_hidden_costs(self.model, store.adapter, store.spec, tokens=tokens,
                                               repeats=self.cfg.profile_repeats)
        return self.hcosts

    def make(self, name: str, wl: Workload, budget: int | None = None) -> Callable[[], object] | None:
        c = self.cfg
        b = budget or c.budget_tokens
        common = (self.model, b, c.max_batch_tokens, c.max_seqs)
        lower = int(c.host_factor * b)
        if name == "hf_stateless":
            return lambda: Stateless(self.model)
        if name == "hf_continuous_batching":
            return lambda: HFContinuousBatching(self.cb_model, b, c.max_batch_tokens, c.max_seqs, c.chunk)
        profile = self.cost_profile(max(x.max_context for x in wl.conversations))
        kw = {"chunk_size": c.chunk, "cost_profile": profile}
        variants = {
            "stateful_hf": {},
            "stateful_hf_lru": {"policy": "lru"},
            "stateful_hf_host": {"host_capacity": lower},
            "stateful_hf_disk": {"disk_dir": None, "disk_capacity": lower},
            "stateful_hf_hidden": {"host_capacity": lower, "hidden_states": "always"},
            "stateful_hf_unshared": {"prefix_sharing": False},      # each session its own copy of a shared prefix
        }
        if name not in variants:
            raise ValueError(f"unknown system {name!r}; choose from {ALL_SYSTEMS}")
        extra = dict(variants[name])
        if "prefix_sharing" in extra and "prefix_sharing" not in store_options():
            self.skipped[name] = "stateful_hf.SessionStore has no prefix_sharing option in this checkout"
            return None
        if "hidden_states" in extra and "hidden_states" not in store_options():
            self.skipped[name] = "stateful_hf.SessionStore has no hidden_states option in this checkout"
            return None
        if "hidden_states" in extra and "hidden_costs" in store_options():
            extra["hidden_costs"] = self.hidden_costs(max(x.max_context for x in wl.conversations))
        if "disk_dir" in extra:
            extra["disk_dir"] = tempfile.mkdtemp(dir=self.tmp.name)
        return lambda: StatefulEngine(name, *common, **kw, **extra)

    def run(self, names: list[str], wl: Workload, users: int = 0, budget: int | None = None,
            label: str = "") -> dict[str, driver.RunResult]:
        results = {}
        for name in names:
            factory = self.make(name, wl, budget)
            if factory is None:
                continue
            try:
                system = factory()
            except Exception as e:          # an optional variant this checkout cannot build
                self.skipped[name] = f"{type(e).__name__}: {e}"
                continue
            results[name] = self._drive(system, wl, users, label)
        return results

    def _drive(self, system, wl: Workload, users: int, label: str) -> driver.RunResult:
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=wl.num_turns, desc=f"{label}{system.name}", unit="turn", leave=False)
        t0 = time.monotonic()
        res = driver.run(system, wl, users, on_turn=(lambda r: bar.update(1)) if bar else None)
        if bar is not None:
            bar.close()
        m = metrics.summarize(res)
        print(f"  {label}{system.name}: {wl.num_turns} turns in {time.monotonic() - t0:.1f} s, "
              f"{m['throughput_tok_s']:.1f} tok/s, TTFT p90 {m['ttft_p90_s']:.3f} s", flush=True)
        return res


def warm_up(model, vocab: int) -> None:
    with torch.inference_mode():
        x = torch.randint(3, vocab, (1, 16))
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False, pad_token_id=0)


def repeated(bench: Bench, systems: list[str], wl: Workload, users: int, repeats: int):
    """Run the systems `repeats` times, interleaved (a, b, c, a, b, c, ...) so that load from other
    processes spreads over all of them; keep each system's run of median throughput."""
    all_runs: dict[str, list[driver.RunResult]] = {}
    for i in range(repeats):
        label = f"[{i + 1}/{repeats}] " if repeats > 1 else ""
        for n, r in bench.run(systems, wl, users, label=label).items():
            all_runs.setdefault(n, []).append(r)
    chosen, spread = {}, {}
    for n, rs in all_runs.items():
        ms = sorted(((metrics.summarize(r), r) for r in rs), key=lambda x: x[0]["throughput_tok_s"])
        chosen[n] = ms[len(ms) // 2][1]
        spread[n] = [{k: m[k] for k in ("throughput_tok_s", "ttft_p90_s", "tok_per_cpu_s")} for m, _ in ms]
    return chosen, spread


def experiment(bench: Bench, wl: Workload, arr: Arrivals, systems: list[str], rates: list[float],
               sweep_systems: list[str], policy_budget: int | None, repeats: int = 1,
               policy_wl: Workload | None = None, oracle: bool = True) -> dict:
    """The main comparison at `arr`, an optional rate sweep, and LRU vs cost-aware under pressure
    (on `policy_wl`, a scheduled workload for the virtual-clock replay; default: the main one)."""
    scheduled = schedule(wl, arr)
    runs, spread = repeated(bench, systems, scheduled, arr.users, repeats)
    out = {"systems": {n: metrics.summarize(r) for n, r in runs.items()}}
    if repeats > 1:
        out["repeats"] = spread
    ref = runs.get("hf_stateless")
    if ref is not None:
        out["same_tokens_as_stateless"] = {n: metrics.agreement(ref, r) for n, r in runs.items()}
    if rates:           # the main run is the sweep's point at its own rate (open loop)
        point = lambda rate, m: {"rate_conv_s": rate, **{k: m[k] for k in (
            "throughput_tok_s", "throughput_req_s", "norm_latency_mean_s", "norm_latency_p90_s", "ttft_p50_s",
            "ttft_p90_s", "recomputed_tokens")}}
        out["sweep"] = {n: [point(arr.rate, out["systems"][n])] for n in sweep_systems
                        if n in out["systems"] and not arr.users}
        for rate in rates:
            if rate == arr.rate and not arr.users and all(n in out["systems"] for n in sweep_systems):
                continue
            sw = schedule(wl, replace(arr, rate=rate, users=0))
            for n, r in bench.run(sweep_systems, sw, 0, label=f"rate {rate:g}: ").items():
                out["sweep"].setdefault(n, []).append(point(rate, metrics.summarize(r)))
    if policy_budget is not None and policy_budget > 0:
        out["policy"] = compare_policies(bench, policy_wl or scheduled, policy_budget, oracle=oracle)
        out["policy"].pop("outputs")
    out["skipped"] = dict(bench.skipped)
    return out


def compare_policies(bench: Bench, wl: Workload, budget: int, replay_model=None, oracle: bool = True) -> dict:
    """The policies of policy.POLICIES (the store's default, return-aware, Pensieve's, LRU) and the
    offline oracle on the same virtual-clock replay of `wl` (policy.py) at `budget` device tokens,
    with Cost(l) measured on the benchmark's model (or the Bench's fixed profile); the replay runs
    `replay_model` (default: a 2-layer Llama with enough positions; token counts do not depend on it)."""
    max_context = max(c.max_context for c in wl.conversations)
    profile = bench.cost_profile(max_context)
    if replay_model is None:
        replay_model = tiny_llama(max_position_embeddings=max(2048, 2 * max_context))
    return policy.compare(replay_model, wl, budget, profile, bench.cfg.chunk, oracle=oracle,
                          log=lambda m: print(m, flush=True))
