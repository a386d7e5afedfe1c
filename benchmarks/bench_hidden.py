"""HCache restore, side by side in one run: a returning session's history of 1024..4096 tokens made
device K/V again from hidden states (every layer), from host K/V (copy), by recomputation (a forward
over the history), and by the planner's layer split (HCache's bubble-free mix, planned from costs
measured here), on a ~110M-parameter MHA Llama (12 layers, hidden 768, 12 heads, random weights).

    python benchmarks/bench_hidden.py [--lengths 1024 2048 4096] [--repeats 3] [--threads N]

Times are medians of `repeats` restores (the store's own `move(..., "device")` for the stored forms,
`integration.restore` for recomputation). On a shared, oversubscribed machine pass `--threads 1`:
with more OpenMP threads than free cores, copies like index_select swing from ~2 ms to ~900 ms.
The CPU runs copies and GEMMs on the same cores (no copy engine), so HCache's planner uses its
serial model there. Not run by CI.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import stateful_hf
from stateful_hf.cache import CostProfile
from stateful_hf.cache.hplan import min_hidden_layers, plan_layers
from stateful_hf.hidden import measure_hidden_costs
from stateful_hf.integration import restore, run_step


def build_model() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=8192,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def timed(setup, fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, each after an untimed `setup`."""
    runs = []
    for _ in range(repeats):
        setup()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return sorted(runs)[len(runs) // 2]


@torch.inference_mode()
def prefill(store, sid: str, ids: list[int], model, piece: int = 1024) -> None:
    store.open(sid)
    for a in range(0, len(ids), piece):
        step = store.plan_step([(sid, ids[a:a + piece], range(a, min(a + piece, len(ids))))])
        run_step(model, step)
        store.commit(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model()
    params = sum(p.numel() for p in model.parameters())
    top = max(args.lengths)
    cap = top + 64
    adapter = stateful_hf.enable(model)
    probe = stateful_hf.SessionStore(model, device_capacity=64, policy="lru")
    costs = measure_hidden_costs(model, adapter, probe.spec, tokens=1024)
    n_layers, kv_layer = adapter.num_layers, 2 * adapter.num_kv_heads * adapter.head_dim
    fastest = plan_layers(costs, n_layers, complement="kv")
    budget = plan_layers(costs, n_layers, complement="kv",
                         min_hidden=min_hidden_layers(0.55, n_layers, adapter.hidden_size, kv_layer))
    print(f"model: {params / 1e6:.1f}M params, {n_layers} layers, hidden {adapter.hidden_size}, MHA; "
          f"torch threads {torch.get_num_threads()}")
    print(f"measured per layer, 1024 tokens: IO_H {costs.io_hidden * 1e3:.2f} ms, IO_KV {costs.io_kv * 1e3:.2f} ms, "
          f"C_H {costs.c_hidden * 1e3:.2f} ms, C_token {costs.c_token * 1e3:.2f} ms, overlap={costs.overlap}")
    for name, p in (("fastest", fastest), ("budget 0.55", budget)):
        print(f"plan ({name}): {p.hidden_layers} hidden + {p.other_layers} {p.complement}; predicted "
              f"{p.predicted * 1e3:.1f} ms vs pure hidden {p.pure_hidden * 1e3:.1f}, pure KV {p.pure_other * 1e3:.1f}")

    kw = dict(device_capacity=cap, host_capacity=cap, policy="lru", cost_profile=CostProfile(),
              hidden_states="always", swap_out_threshold=0.0)
    splits = {"hidden": n_layers, "mix": fastest.hidden_layers, "mix-budget": budget.hidden_layers}
    stores = {}
    ids = torch.randint(0, 32000, (top,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, l_h in splits.items():
        if l_h in [s.hidden_spec.hidden_layers for s in stores.values()]:
            stores[name] = next(s for s in stores.values() if s.hidden_spec.hidden_layers == l_h)
            continue
        t0 = time.perf_counter()
        stores[name] = stateful_hf.SessionStore(model, hidden_layers=l_h, **kw)
        prefill(stores[name], "s", ids, model)
        print(f"prefilled {top} tokens for the {name} store ({l_h} hidden layers) in {time.perf_counter() - t0:.1f} s")

    bs = stores["hidden"].block_size
    print("\n tokens | hidden ms | host KV ms | recompute ms | mix ms (L_H) | mix-budget ms (L_H) |"
          " KV/hidden | recompute/hidden | mix/min(pure) | hidden B/tok vs KV")
    for n in sorted(args.lengths):
        ks = list(range(n // bs))
        t = {}
        for name in ("hidden", "mix", "mix-budget"):
            st = stores[name]
            t[name] = timed(lambda st=st, ks=ks: st.move("s", ks, "hidden"),
                            lambda st=st, ks=ks: st.move("s", ks, "device"), args.repeats)
        st = stores["hidden"]
        t["kv"] = timed(lambda st=st, ks=ks: st.move("s", ks, "host"),
                        lambda st=st, ks=ks: st.move("s", ks, "device"), args.repeats)
        cache = st.cache("s")              # recomputation also makes the chunks capturable again
        t["recompute"] = timed(lambda st=st, ks=ks: st.move("s", ks, "dropped"),
                               lambda cache=cache: restore(model, cache), args.repeats)
        best_pure = min(t["hidden"], t["kv"])
        hb = stores["mix-budget"].hidden_spec.bytes_per_token / st.spec.bytes_per_token
        print(f" {n:6d} | {t['hidden'] * 1e3:9.1f} | {t['kv'] * 1e3:10.1f} | {t['recompute'] * 1e3:12.1f} | "
              f"{t['mix'] * 1e3:7.1f} ({splits['mix']:2d}) | "
              f"{t['mix-budget'] * 1e3:13.1f} ({splits['mix-budget']:2d}) | "
              f"{t['kv'] / t['hidden']:9.3f} | {t['recompute'] / t['hidden']:16.2f} | "
              f"{t['mix'] / best_pure:13.2f} | {hb:.3f} (budget split), 0.500 (all hidden)")
    for st in {id(s): s for s in stores.values()}.values():
        st.check_integrity()


if __name__ == "__main__":
    main()
