"""TTFT of a returning session parked on the host / disk tier, with and without a hint sent ahead.

A session with a long history is parked on a lower tier; its next turn (the history plus `--new`
fresh tokens, one output token) is submitted to a running engine. "no hint": the turn's own step
copies the history up. "hint": `engine.hint(session)` is sent first and the turn arrives after the
prefetch finished (a user typing for a few seconds; Symphony measured 11.3 s on ShareGPT), so the
copy is off the critical path. Trials alternate the two, the session is cut back to the same history
after every turn, and the medians are compared as a ratio (and the median of the per-pair ratios,
which is robust to load that drifts during the run), all in one run. On a CPU-only machine the
"device" is host memory too, so the saving is a memcpy; on a GPU it is a PCIe transfer.

    python -m benchmarks.bench_hints                  # ~100M-parameter Llama, 4096-token history
    python -m benchmarks.bench_hints --quick          # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def build_model(layers: int, hidden: int, heads: int, vocab: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=16384, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def run(args) -> dict:
    import stateful_hf
    from stateful_hf import Engine, SamplingParams

    torch.set_num_threads(args.threads) if args.threads else None
    model = build_model(args.layers, args.hidden, args.heads, args.vocab)
    gen = torch.Generator().manual_seed(1)
    history = torch.randint(5, args.vocab, (args.context,), generator=gen).tolist()
    turn = history + torch.randint(5, args.vocab, (args.new,), generator=gen).tolist()
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    results = {"config": vars(args).copy(), "tiers": {}}
    with tempfile.TemporaryDirectory() as disk_dir:
        cap = args.context + 4 * args.chunk
        # The device holds the history plus the engine's 10% admission reserve (a hint keeps it free).
        store = stateful_hf.SessionStore(model, int(1.2 * cap), chunk_size=args.chunk, host_capacity=cap,
                                         disk_dir=disk_dir, disk_capacity=cap, policy="lru")
        kv_mib = store.spec.bytes_per_token * args.context / 2**20
        engine = Engine(model, store=store, max_batch_tokens=max(512, args.new)).start()
        t0 = time.monotonic()
        engine.submit("s", history, one).result()            # the session's history, computed once
        print(f"history: {args.context} tokens, KV {kv_mib:.0f} MiB; prefilled in {time.monotonic() - t0:.1f} s")
        n_chunks = len(store.session("s").chunks)

        def trial(tier: str | None, hint: bool) -> tuple[float, float | None]:
            store.truncate("s", args.context)
            if tier is not None:
                store.move("s", range(n_chunks), tier)
            hint_s = None
            if hint:
                h = engine.hint("s")
                if not h.wait(120) or h.stopped != "done":
                    raise RuntimeError(f"hint did not finish: {h}")
                hint_s = h.finished_at - h.sent_at
                time.sleep(args.think)                        # the user is still typing
            out = engine.submit("s", turn, one).result()
            return out.metrics.ttft, hint_s

        for _ in range(2):                                    # warm up every path once
            trial(None, False)
        tiers = [t for t in args.tiers.split(",") if t]
        base = [trial(None, False)[0] for _ in range(args.trials)]
        results["device_ttft_ms"] = 1e3 * statistics.median(base)
        print(f"\nreturning turn: {args.new} new tokens over a {args.context}-token history "
              f"(median of {args.trials}); history already on the device: TTFT {results['device_ttft_ms']:.1f} ms")
        print(f"{'parked on':>10} | {'TTFT no hint':>12} | {'TTFT hint':>10} | {'ratio':>6} | {'paired':>6} | "
              f"{'hint took':>9}")
        for tier in tiers:
            cold, warm, took = [], [], []
            for _ in range(args.trials):
                cold.append(trial(tier, False)[0])
                ttft, hint_s = trial(tier, True)
                warm.append(ttft)
                took.append(hint_s)
            r = {"no_hint_ttft_ms": 1e3 * statistics.median(cold), "hint_ttft_ms": 1e3 * statistics.median(warm),
                 "hint_seconds_ms": 1e3 * statistics.median(took), "no_hint_all_ms": [1e3 * x for x in cold],
                 "hint_all_ms": [1e3 * x for x in warm]}
            r["ratio"] = r["no_hint_ttft_ms"] / r["hint_ttft_ms"]
            r["paired_ratio"] = statistics.median(c / w for c, w in zip(cold, warm))   # robust to load drift
            results["tiers"][tier] = r
            print(f"{tier:>10} | {r['no_hint_ttft_ms']:>9.1f} ms | {r['hint_ttft_ms']:>7.1f} ms | "
                  f"{r['ratio']:>5.2f}x | {r['paired_ratio']:>5.2f}x | {r['hint_seconds_ms']:>6.1f} ms")
        engine.stop()
        store.check_integrity()
        print("\n" + store.summary())
        store.close()
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096, help="history tokens of the returning session")
    p.add_argument("--new", type=int, default=32, help="new prompt tokens of the returning turn")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--think", type=float, default=0.2, help="seconds between the hint's end and the turn")
    p.add_argument("--tiers", default="host,disk")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--quick", action="store_true", help="2048-token history, 6 layers, 3 trials")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.layers, args.trials = 2048, 6, 3
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
