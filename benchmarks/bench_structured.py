"""What structured output costs a step: 24 concurrent constrained requests against the same 24 free, step by step.

    python -m benchmarks.bench_structured --json benchmarks/results/structured_cost_smollm2.json

SmolLM2-135M-Instruct (float32, `stateful_hf.models`), loaded twice: one Engine serves 24 free chat
requests (ignore_eos, so all 24 decode `--new` tokens), the other the same 24 prompts constrained
(`--constraint schema`: a JSON schema, or `json_object`). The two engines are stepped alternately in
this one thread (`Engine.step()`, no background loop; one torch thread unless `--threads`), the first
of each pair alternating between rounds, so each constrained step is timed beside a free step of the
same shape under the same load: on a shared machine the load changes far more between runs than
between two consecutive steps. A step's cost is its `StepRecord.seconds`; only pairs where both steps
decode all 24 requests (24 one-row entries, nothing else) count. Reported: the median of the pairs'
ratios constrained / free (the target: <= 1.10) and its interquartile range, each side's median step,
and the time spent inside the grammar per step (the mask's fill and apply, `grammar.mask_logits`; the
matchers' advance, `grammar.accept_tokens`). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from stateful_hf import Engine, SamplingParams
from stateful_hf.engine import grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "field", "born", "facts"],
          "properties": {"name": {"type": "string"}, "field": {"type": "string"}, "born": {"type": "integer"},
                         "facts": {"type": "array", "items": {"type": "string"}}}}
TOPICS = ["Marie Curie", "Alan Turing", "Ada Lovelace", "Isaac Newton", "Rosalind Franklin", "Niels Bohr",
          "Emmy Noether", "Charles Darwin", "Lise Meitner", "Gregor Mendel", "Katherine Johnson", "Nikola Tesla"]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON with keys name, field, born "
              f"and facts (request {i})."}] for i in range(n)]


class GrammarClock:
    """Seconds spent in grammar.mask_logits and grammar.accept_tokens, per step (patched in for the run)."""

    def __init__(self):
        self.mask, self.accept = [], []
        self._orig = grammar.mask_logits, grammar.accept_tokens

    def __enter__(self) -> GrammarClock:
        mask, accept = self._orig

        def timed_mask(logits, requests):
            t0 = time.perf_counter()
            mask(logits, requests)
            self.mask.append(time.perf_counter() - t0)

        def timed_accept(requests, tokens):
            t0 = time.perf_counter()
            accept(requests, tokens)
            self.accept.append(time.perf_counter() - t0)
        grammar.mask_logits, grammar.accept_tokens = timed_mask, timed_accept
        return self

    def __exit__(self, *exc) -> None:
        grammar.mask_logits, grammar.accept_tokens = self._orig


def full_decode(record, batch: int) -> bool:
    return record is not None and record.num_decode == batch and len(record.entries) == batch


def run_round(free: Engine, con: Engine, batch: int, new: int, constraint, tag: str, con_first: bool,
              clock: GrammarClock) -> tuple[list[tuple[float, float]], list]:
    """One round: both engines get the 24 prompts, then are stepped alternately until both are done.
    Returns the (free, constrained) seconds of the pairs where both decoded all requests, and the
    constrained outputs."""
    hf = [free.submit(f"{tag}-f{i}", p, SamplingParams(max_new_tokens=new, ignore_eos=True))
          for i, p in enumerate(prompts(batch))]
    hc = [con.submit(f"{tag}-c{i}", p, SamplingParams(max_new_tokens=new, constraint=constraint))
          for i, p in enumerate(prompts(batch))]
    pairs = []
    while free.has_work() or con.has_work():
        if con_first:
            with clock:
                rc = con.step()
            rf = free.step()
        else:
            rf = free.step()
            with clock:
                rc = con.step()
        if full_decode(rf, batch) and full_decode(rc, batch):
            pairs.append((rf.seconds, rc.seconds))
    outs = [h.result() for h in hc]
    for h in hf:
        assert h.result().error is None
    for e, key in ((free, "f"), (con, "c")):     # free the sessions: every round starts from the same stores
        for i in range(batch):
            e.store.delete(f"{tag}-{key}{i}")
    return pairs, outs


def run(args) -> dict:
    from stateful_hf.models import DEFAULT_MODEL, load
    if args.threads:
        torch.set_num_threads(args.threads)
    (m1, tok), (m2, _) = load(DEFAULT_MODEL, dtype=torch.float32), load(DEFAULT_MODEL, dtype=torch.float32)
    free, con = Engine(m1, tok, max_num_seqs=args.batch), Engine(m2, tok, max_num_seqs=args.batch)
    constraint = SCHEMA if args.constraint == "schema" else "json_object"
    warm = GrammarClock()
    run_round(free, con, args.batch, 4, constraint, "warm", False, warm)    # compiles and caches the grammar
    pairs, clock, valid, finished = [], GrammarClock(), 0, 0
    for r in range(args.rounds):
        got, outs = run_round(free, con, args.batch, args.new, constraint, f"r{r}", r % 2 == 1, clock)
        pairs += got
        done = [o for o in outs if o.finish_reason == "stop"]
        finished += len(done)
        valid += sum(_parses(o.text) for o in done)
        ratios = [c / f for f, c in got]
        print(f"round {r}: {'constrained' if r % 2 else 'free'} first; {len(got)} pairs, free median "
              f"{1e3 * statistics.median(f for f, _ in got):.1f} ms, constrained median "
              f"{1e3 * statistics.median(c for _, c in got):.1f} ms, median pair ratio {statistics.median(ratios):.3f}")
    ratios = sorted(c / f for f, c in pairs)
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    return {"model": DEFAULT_MODEL, "batch": args.batch, "new": args.new, "rounds": args.rounds,
            "constraint": args.constraint, "torch_threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg(), "pairs": len(pairs),
            "pair_ratio_median": statistics.median(ratios), "pair_ratio_q1": q1, "pair_ratio_q3": q3,
            "free_step_ms_median": 1e3 * statistics.median(f for f, _ in pairs),
            "constrained_step_ms_median": 1e3 * statistics.median(c for _, c in pairs),
            "grammar_mask_ms_per_step_median": 1e3 * statistics.median(clock.mask),
            "grammar_accept_ms_per_step_median": 1e3 * statistics.median(clock.accept),
            "constrained_finished": finished, "constrained_finished_valid_json": valid}


def _parses(text: str | None) -> bool:
    try:
        json.loads(text or "")
        return True
    except ValueError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--new", type=int, default=32, help="tokens per request (a constrained one may stop sooner)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--constraint", choices=("json_object", "schema"), default="schema")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the stepping thread (0: torch's); "
                   "on a shared host a team of 2 stalls in OpenMP waits and steps swing by seconds")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    res = run(args)
    print(f"{res['pairs']} step pairs of {args.batch} decoding requests: constrained / free "
          f"x{res['pair_ratio_median']:.3f} (median; quartiles {res['pair_ratio_q1']:.3f}-{res['pair_ratio_q3']:.3f}); "
          f"medians free {res['free_step_ms_median']:.1f} ms, constrained {res['constrained_step_ms_median']:.1f} ms; "
          f"in the grammar per step: mask {res['grammar_mask_ms_per_step_median']:.2f} ms, accept "
          f"{res['grammar_accept_ms_per_step_median']:.2f} ms; load average {res['load_average_at_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
