"""One prompt, many times, in changing company: how many different answers? (Thinking Machines' test.)

    python -m benchmarks.bench_invariant                                  # 1,000 trials, SmolLM2 in bf16
    python -m benchmarks.bench_invariant --trials 100 --new 16 --json benchmarks/results/invariant.json

The same chat prompt is submitted `trials` times as separate sessions, in waves of random size, each
wave beside random other prompts of random lengths, so every trial's steps see a different batch (row
counts, prefill chunks, team sizes). Greedy decoding: any difference between trials is batch-dependent
rounding. Run once with the stock engine and once with `batch_invariant=True`; reported: unique answers
per mode, and whether the invariant answers equal stateless `generate` under
`stateful_hf.batch_invariant()` (the oracle).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter

import torch

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.models import load

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(model, tokenizer, trials: int, new: int, invariant: bool, seed: int) -> tuple[Counter, float]:
    rng = random.Random(seed)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    engine = Engine(model, device_capacity=max(8192, 64 * (len(ids) + new)), max_batch_tokens=128,
                    max_num_seqs=64, batch_invariant=invariant)
    answers: Counter = Counter()
    done, t0 = 0, time.perf_counter()
    while done < trials:
        wave = min(rng.randint(1, 24), trials - done)
        handles = [engine.submit(f"t{done + i}", ids, SamplingParams(max_new_tokens=new)) for i in range(wave)]
        for j in range(rng.randint(0, 8)):                    # company: other prompts of other lengths
            noise = [rng.randrange(3, 30000) for _ in range(rng.randint(5, 200))]
            engine.submit(f"n{done}-{j}", noise, SamplingParams(max_new_tokens=rng.randint(1, new)))
        while engine.has_work():
            engine.step()
        answers.update(tuple(h.result().token_ids) for h in handles)
        for sid in list(engine.store.session_ids()):
            engine.store.delete(sid)
        if (done + wave) // 100 > done // 100:
            print(f"  {done + wave} trials: {len(answers)} unique ({time.perf_counter() - t0:.0f} s)", flush=True)
        done += wave
    return answers, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="stock,batch_invariant",
                    help="which engines to run, in order: stock (the negative control), batch_invariant")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"stock", "batch_invariant"}:
        ap.error(f"--modes: a comma-separated list of stock and batch_invariant, got {a.modes!r}")
    model, tokenizer = load(a.model, dtype=a.dtype)
    oracle = load(a.model, dtype=a.dtype)[0]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    x = torch.tensor([ids])
    with torch.inference_mode(), stateful_hf.batch_invariant(32):
        want = tuple(oracle.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.new,
                                     do_sample=False)[0, len(ids):].tolist())
    report = {"command": "python -m benchmarks.bench_invariant " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": a.model, "dtype": a.dtype, "trials": a.trials, "new": a.new, "load_start": os.getloadavg(),
              "modes": {}}
    for name in modes:
        answers, seconds = run(model, tokenizer, a.trials, a.new, name == "batch_invariant", a.seed)
        report["modes"][name] = {"unique_answers": len(answers), "seconds": seconds, "trials": a.trials,
                                 "most_common_count": answers.most_common(1)[0][1],
                                 "equal_to_oracle": answers.get(want, 0)}
        print(f"{name:>16}: {len(answers)} unique answers in {a.trials} trials ({seconds:.0f} s); "
              f"{answers.get(want, 0)} equal to generate under batch_invariant()", flush=True)
        report["load_end"] = os.getloadavg()
        if a.json:                                 # after every mode: a cut-short run keeps what it measured
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
