"""A returning turn's cost against the number of idle sessions a store holds (issue: scale).

    python -m benchmarks.bench_scale --sizes 100 1000 10000 --turns 30 --json benchmarks/results/bench_scale.json

One store per size, each holding that many idle conversations of `--tokens` tokens (tiny Llama, one
torch thread), their KV on the host tier; every store has the same device capacity. Stores are filled
through the store's own export / import from one prefilled session (each copy its own tenant, so no
prefix is shared; then moved to the host), so 10^4 sessions take seconds. Then returning turns of
`--new` new tokens (greedy, one generated token) run on sessions picked at random, round-robin over
the sizes (interleaved, so load drift hits every size alike), through `model.generate` and through
`Engine`. Each turn's answer is checked against stateless `generate` on the same ids: a wrong token
fails the run. Reported per size and path: median and p99 milliseconds, and their ratio to the
smallest size; the Python heap per idle session (tracemalloc over the fill, KV pools excluded: they
are preallocated). `gc.freeze()` after filling keeps the collector off the held sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch

from stateful_hf import Engine, SamplingParams, SessionStore
from stateful_hf.cache import session_key
from stateful_hf.cache.eviction.policy import DEFAULT_POLICY, POLICY_NAMES, FairSharePolicy, make_policy
from stateful_hf.cache.movement.migration import SessionExport
from stateful_hf.testing import tiny_llama


def open_store(model, size: int, tokens: int, device_tokens: int, disk: str | None, host_tokens: int, grow: int,
               tenants: int | None, policy_name: str = DEFAULT_POLICY) -> SessionStore:
    """The store `fill` fills (and `--restart` reopens from its disk directory): the same options each time."""
    held = (size + 8) * (tokens + grow) + 4096       # `grow`: room for what later turns add to each
    policy = make_policy(policy_name) if tenants is None else FairSharePolicy(make_policy(policy_name))
    if disk is None:
        return SessionStore(model, device_tokens, host_capacity=held, policy=policy)
    return SessionStore(model, device_tokens, host_capacity=host_tokens, disk_dir=disk, disk_capacity=held,
                        policy=policy)


def fill(model, size: int, tokens: int, device_tokens: int, seed_ids: list[int], disk: str | None = None,
         host_tokens: int = 0, grow: int = 0, tenants: int | None = None,
         policy: str = DEFAULT_POLICY) -> tuple[SessionStore, list[str], float, SessionExport]:
    """A store holding `size` idle copies of one prefilled session on the host, or (`disk`: the disk tier's
    directory) on disk beside a host tier of `host_tokens`; (store, ids, heap bytes per session added by the fill,
    the seed's export).
    `tenants`: the sessions spread over that many tenants under the fair share (the server's default
    policy); None: each its own tenant, under the store's default policy. One bulk import
    (`import_sessions`: one lock, one commit of the disk index)."""
    store = open_store(model, size, tokens, device_tokens, disk, host_tokens, grow, tenants, policy)
    ids = torch.tensor([seed_ids])
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=store.cache("seed"), max_new_tokens=1,
                   do_sample=False, pad_token_id=0)
    store.truncate("seed", tokens)
    exp = store.export_session("seed")
    store.delete("seed")
    sids = [session_key(f"t{i}", "c") if tenants is None else session_key(f"t{i % tenants}", f"c{i}")
            for i in range(size)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store.import_sessions((dataclasses.replace(exp, session_id=sid) for sid in sids),
                          "host" if disk is None else "disk")
    store.tenant_usage()                             # the table's token counts of every session, taken
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return store, sids, (after - before) / size, exp


def put_back(store, exp, sids: list[str], disk: bool) -> None:
    """Sessions that had a turn become idle copies of the seed (`exp`) again, where the fill put them, so
    that a store keeps holding `size` idle sessions of one shape however many turns run on it."""
    store.import_sessions((dataclasses.replace(exp, session_id=sid) for sid in sids), "disk" if disk else "host")


def turn_generate(model, store, sid: str, prompt: list[int]) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=store.cache(sid),
                         max_new_tokens=1, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, out[0, len(prompt):].tolist()


def turn_engine(engine, sid: str, prompt: list[int]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = engine.submit(sid, prompt, SamplingParams(max_new_tokens=1)).result()
    return time.perf_counter() - t0, list(out.token_ids)


def closed_loop(model, size: int, a: argparse.Namespace, seed_ids: list[int], rng: random.Random) -> dict:
    """`size` sessions each with one turn queued at all times (a finished turn's session submits its next
    at once), on one store and engine of the same device tier as every other size; tokens a second over
    `a.loop_turns` finished turns after a warm-up of `size` turns (so that every session has run once)."""
    store, sids, _, _ = fill(model, size, a.tokens, a.device_tokens, seed_ids, grow=64,   # every turn's KV stays held
                          tenants=a.tenants, policy=a.policy)
    engine = Engine(model, store=store, step_threads=None, arrival_window=0).start()
    vocab, done = model.config.vocab_size, queue.Queue()
    history = seed_ids[:a.tokens]
    prompts = {sid: history + [rng.randrange(3, vocab) for _ in range(a.new)] for sid in sids}
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def submit(sid: str) -> None:
        handle = engine.submit(sid, prompts[sid], sampling)
        engine.requests.when_finished(handle, lambda out, sid=sid: done.put((sid, out)))

    for sid in sids:
        submit(sid)
    t0, tokens, wrong = 0.0, 0, 0
    for n in range(size + a.loop_turns):
        sid, out = done.get()
        if n == size:                          # warm-up over: every session ran a turn
            t0, tokens, before = time.perf_counter(), 0, store.stats().counters
        tokens += len(out.token_ids)
        wrong += out.error is not None
        submit(sid)
    seconds, after = time.perf_counter() - t0, store.stats().counters
    engine.stop()
    store.close()
    moved = {f: getattr(after, f) - getattr(before, f) for f in ("device_hits", "swapped_in_host")}
    return {"sessions": size, "tokens_per_s": round(tokens / seconds, 1), "turns": a.loop_turns, "errors": wrong,
            **moved}     # history tokens found on the device vs copied up from the host over the timed turns


def restart(model, size: int, sids: list[str], a: argparse.Namespace, disk: str, history: list[int],
            rng: random.Random) -> dict:
    """The closed store of `size` sessions reopened from its disk directory (timed: the index read, every
    session restored), then `a.turns` returning turns through `generate` on sessions not used before, each
    checked against stateless `generate`."""
    gc.collect()
    t0 = time.perf_counter()
    store = open_store(model, size, a.tokens, a.device_tokens, disk, a.host_tokens, 0, a.tenants, a.policy)
    seconds = time.perf_counter() - t0
    restored = store.stats().sessions
    times, wrong, vocab = [], 0, model.config.vocab_size
    for _ in range(min(a.turns, len(sids))):
        sid = sids.pop(rng.randrange(len(sids)))
        prompt = history + [rng.randrange(3, vocab) for _ in range(a.new)]
        t, got = turn_generate(model, store, sid, prompt)
        times.append(t)
        wrong += got != stateless(model, prompt)
    store.check_integrity()
    reused = store.stats().counters
    store.close()
    return {"sessions": size, "restart_s": round(seconds, 3), "restored": restored, "turns": a.turns, "wrong": wrong,
            "generate_median_ms": round(1e3 * statistics.median(times), 3),
            "generate_p99_ms": round(1e3 * pct(times, 0.99), 3),
            "history_tokens_from_disk": reused.swapped_in_disk}


def stateless(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000], help="idle sessions held per store")
    ap.add_argument("--turns", type=int, default=30, help="returning turns per size and path")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per held conversation")
    ap.add_argument("--new", type=int, default=3, help="new tokens of a returning turn")
    ap.add_argument("--device-tokens", type=int, default=1024, help="the device tier of every store")
    ap.add_argument("--tier", choices=("host", "disk"), default="host",
                    help="where the held sessions are: host (a host tier holding them all), or disk (beside a host "
                    "tier of --host-tokens, so that every returning turn makes room in the host tier)")
    ap.add_argument("--host-tokens", type=int, default=4096, help="the host tier with --tier disk")
    ap.add_argument("--closed-loop", type=int, nargs="*", default=[],
                    help="also: engine throughput with this many sessions each with a turn always queued "
                    "(e.g. 100 10000)")
    ap.add_argument("--loop-turns", type=int, default=300, help="finished turns timed per closed-loop size")
    ap.add_argument("--tenants", type=int,
                    help="spread the sessions over this many tenants under the fair share, the server's default "
                    "policy (default: each session its own tenant, under the store's default policy)")
    ap.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY,
                    help="the eviction policy (with --tenants: the fair share over it)")
    ap.add_argument("--restart", action="store_true",
                    help="with --tier disk: afterwards close each store, reopen it from its disk directory (timed) and "
                    "run --turns returning turns on it")
    ap.add_argument("--layers", type=int, default=2,
                    help="the tiny model's layers (1 with --kv-heads 1: 4 KiB a chunk)")
    ap.add_argument("--kv-heads", type=int, default=2, help="the tiny model's KV heads (head_dim 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures and the environment here")
    a = ap.parse_args(argv)
    if a.restart and a.tier != "disk":
        ap.error("--restart needs --tier disk (only the disk tier outlives the store)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(a, argv)
    finally:                                   # as it was, for a caller in the same process (the test)
        torch.set_num_threads(threads)
        gc.unfreeze()


def run(a: argparse.Namespace, argv) -> dict:
    rng = random.Random(a.seed)
    model = tiny_llama(num_hidden_layers=a.layers, num_key_value_heads=a.kv_heads)
    vocab = model.config.vocab_size
    seed_ids = [rng.randrange(3, vocab) for _ in range(a.tokens + 1)]
    stores = {}
    tmp = tempfile.TemporaryDirectory(prefix="bench_scale_") if a.tier == "disk" else None
    for size in a.sizes:
        t0 = time.perf_counter()
        disk = None if tmp is None else os.path.join(tmp.name, str(size))
        store, sids, heap, exp = fill(model, size, a.tokens, a.device_tokens, seed_ids, disk, a.host_tokens,
                                 tenants=a.tenants, policy=a.policy)
        fill_s = time.perf_counter() - t0
        store.stats()                          # the first read after the bulk import prunes its marks
        t1 = time.perf_counter()
        store.stats()                          # a metrics scrape's read (docs/scale.md): timed
        stores[size] = {"store": store, "sids": sids, "used": [], "exp": exp, "heap_per_session": heap,
                        "fill_s": fill_s, "stats_ms": 1e3 * (time.perf_counter() - t1),
                        "engine": Engine(model, store=store, step_threads=None, arrival_window=0)}
        print(f"{size} sessions held: filled in {stores[size]['fill_s']:.1f} s, {heap:.0f} B of Python heap each",
              flush=True)
    gc.collect()
    gc.freeze()
    history = seed_ids[:a.tokens]
    times = {size: {"generate": [], "engine": []} for size in a.sizes}
    wrong = 0
    for _ in range(a.turns):
        for path in ("generate", "engine"):
            for size in a.sizes:
                st = stores[size]
                if not st["sids"]:             # every held session had a turn: put them back, untimed
                    put_back(st["store"], st["exp"], st["used"], tmp is not None)
                    st["sids"], st["used"] = st["used"], []
                sid = st["sids"].pop(rng.randrange(len(st["sids"])))
                st["used"].append(sid)
                prompt = history + [rng.randrange(3, vocab) for _ in range(a.new)]
                if path == "generate":
                    t, got = turn_generate(model, st["store"], sid, prompt)
                else:
                    t, got = turn_engine(st["engine"], sid, prompt)
                if got != stateless(model, prompt):
                    wrong += 1
                times[size][path].append(t)
    for st in stores.values():
        st["store"].check_integrity()
        st["engine"].stop()
        if a.restart:                          # the restart's turns: on idle sessions on disk
            put_back(st["store"], st["exp"], st["used"], True)
            st["sids"] += st["used"]
        st["store"].close()
        del st["store"], st["engine"]
    gc.unfreeze()
    restarts = [restart(model, size, stores[size]["sids"], a, os.path.join(tmp.name, str(size)), history, rng)
                for size in a.sizes] if a.restart else []
    wrong += sum(r["wrong"] for r in restarts)
    if tmp is not None:
        tmp.cleanup()
    base = a.sizes[0]
    rows = []
    for size in a.sizes:
        row = {"sessions": size, "chunks": size * -(-a.tokens // 32),
               "heap_bytes_per_session": round(stores[size]["heap_per_session"], 1),
               "fill_s": round(stores[size]["fill_s"], 2), "stats_ms": round(stores[size]["stats_ms"], 2)}
        for path in ("generate", "engine"):
            xs = times[size][path]
            med, p99 = statistics.median(xs), pct(xs, 0.99)
            row[f"{path}_median_ms"], row[f"{path}_p99_ms"] = round(1e3 * med, 3), round(1e3 * p99, 3)
            row[f"{path}_median_x"] = round(med / statistics.median(times[base][path]), 3)
            row[f"{path}_p99_x"] = round(p99 / pct(times[base][path], 0.99), 3)
        rows.append(row)
    print(f"\n{'sessions':>9} {'heap B':>8}  {'gen med ms':>10} {'x':>6} {'gen p99':>8} {'x':>6}  "
          f"{'eng med ms':>10} {'x':>6} {'eng p99':>8} {'x':>6}")
    for r in rows:
        print(f"{r['sessions']:>9} {r['heap_bytes_per_session']:>8.0f}  {r['generate_median_ms']:>10.2f} "
              f"{r['generate_median_x']:>6.2f} {r['generate_p99_ms']:>8.2f} {r['generate_p99_x']:>6.2f}  "
              f"{r['engine_median_ms']:>10.2f} {r['engine_median_x']:>6.2f} {r['engine_p99_ms']:>8.2f} "
              f"{r['engine_p99_x']:>6.2f}")
    for r in restarts:
        print(f"restart with {r['sessions']} sessions on disk: the store reopened in {r['restart_s']:.2f} s "
              f"({r['restored']} restored); then returning turns: median {r['generate_median_ms']:.2f} ms, "
              f"p99 {r['generate_p99_ms']:.2f} ms")
    checked = 2 * a.turns * len(a.sizes) + sum(r["turns"] for r in restarts)
    print(f"answers checked against stateless generate: {checked - wrong} right, {wrong} wrong")
    loop = []
    for size in a.closed_loop:
        loop.append(closed_loop(model, size, a, seed_ids, rng))
        base_rate = loop[0]["tokens_per_s"]
        loop[-1]["vs_first"] = round(base_rate / loop[-1]["tokens_per_s"], 3)   # time per token vs the first size
        print(f"closed loop, {size} sessions queued: {loop[-1]['tokens_per_s']} tokens/s "
              f"(x{loop[-1]['vs_first']} the first size's time per token), {loop[-1]['errors']} errors; history "
              f"tokens on the device {loop[-1]['device_hits']}, copied up from the host {loop[-1]['swapped_in_host']}",
              flush=True)
        wrong += loop[-1]["errors"]
    command = "python -m benchmarks.bench_scale " + " ".join(sys.argv[1:] if argv is None else argv)
    out = {"command": command, "rows": rows, "wrong": wrong, "restarts": restarts,
           "closed_loop": loop, "layers": a.layers, "kv_heads": a.kv_heads, "turns": a.turns,
           "tokens": a.tokens, "new": a.new, "device_tokens": a.device_tokens,
           "tier": a.tier, "tenants": a.tenants, "policy": a.policy,
           "host_tokens": a.host_tokens if a.tier == "disk" else None,
           "torch": torch.__version__, "load": list(os.getloadavg())}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if wrong:
        raise SystemExit(f"{wrong} answers differ from stateless generate")
    return out


if __name__ == "__main__":
    main()
