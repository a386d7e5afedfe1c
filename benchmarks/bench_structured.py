"""What structured output costs a step: 24 concurrent constrained requests against the same 24 free, in one run.

    python -m benchmarks.bench_structured --json benchmarks/results/structured_cost_smollm2.json

SmolLM2-135M-Instruct (float32, `stateful_hf.models`) in one Engine. A round runs the same 24 chat
prompts twice through the engine, once free (ignore_eos, so all 24 decode to `--new` tokens) and once
with a constraint (`--constraint json_object`, or `schema`: a JSON schema), in an order that alternates
between rounds. A step's cost is its `StepRecord.seconds`; only steps where all 24 requests decode
(24 one-row entries, nothing else) count, so both sides time the same step shape. Reported: per side
the median decode step over all rounds, the ratio constrained / free (the target: <= 1.10), the median
of the per-round ratios, and the time spent inside the grammar per step (the mask's fill and apply,
`grammar.mask_logits`, and the matchers' advance, `grammar.accept_tokens`). On a shared machine the
A/B ratio swings with the neighbours' load, so the same steps are also measured from inside: the
constrained steps' median over that median less the grammar's time per step (`in_step_ratio`: what the
grammar adds to the very steps it ran in). Not run by CI.
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


def run_side(engine: Engine, batch: int, new: int, constraint, tag: str) -> tuple[list[float], list]:
    """(seconds of the steps where all `batch` requests decoded, outputs) of one side of a round."""
    first = len(engine.steps)
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=constraint is None, constraint=constraint)
    outs = engine.generate([f"{tag}-{i}" for i in range(batch)], prompts(batch), sampling)
    for o in outs:
        assert o.error is None, o.error
    steps = list(engine.steps)[first:]
    decode = [s.seconds for s in steps if s.num_decode == batch and len(s.entries) == batch]
    for i in range(batch):                     # free the sessions: both sides start from the same store
        engine.store.delete(f"{tag}-{i}")
    return decode, outs


def run(args) -> dict:
    from stateful_hf.models import DEFAULT_MODEL, load
    model, tok = load(DEFAULT_MODEL, dtype=torch.float32)
    engine = Engine(model, tok, max_num_seqs=args.batch)
    constraint = SCHEMA if args.constraint == "schema" else "json_object"
    run_side(engine, args.batch, 4, constraint, "warm-c")        # compiles and caches the grammar
    run_side(engine, args.batch, 4, None, "warm-f")
    free_steps, con_steps, ratios, clock = [], [], [], GrammarClock()
    valid = 0
    for r in range(args.rounds):
        order = ("free", "constrained") if r % 2 == 0 else ("constrained", "free")
        got = {}
        for side in order:
            if side == "free":
                got[side], _ = run_side(engine, args.batch, args.new, None, f"f{r}")
            else:
                with clock:
                    got[side], outs = run_side(engine, args.batch, args.new, constraint, f"c{r}")
                valid += sum(_parses(o.text) for o in outs if o.finish_reason == "stop")
        free_steps += got["free"]
        con_steps += got["constrained"]
        if got["free"] and got["constrained"]:
            ratios.append(statistics.median(got["constrained"]) / statistics.median(got["free"]))
        print(f"round {r}: {order[0]} first; decode steps free {len(got['free'])} median "
              f"{1e3 * statistics.median(got['free']):.1f} ms, constrained {len(got['constrained'])} median "
              f"{1e3 * statistics.median(got['constrained']):.1f} ms, ratio {ratios[-1]:.3f}")
    engine.stop()
    free_ms, con_ms = 1e3 * statistics.median(free_steps), 1e3 * statistics.median(con_steps)
    grammar_ms = 1e3 * (statistics.median(clock.mask) + statistics.median(clock.accept))
    return {"model": DEFAULT_MODEL, "batch": args.batch, "new": args.new, "rounds": args.rounds,
            "constraint": args.constraint, "torch_threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg(),
            "free_step_ms_median": free_ms, "constrained_step_ms_median": con_ms, "ratio": con_ms / free_ms,
            "per_round_ratios": ratios, "per_round_ratio_median": statistics.median(ratios),
            "decode_steps": {"free": len(free_steps), "constrained": len(con_steps)},
            "grammar_mask_ms_per_step_median": 1e3 * statistics.median(clock.mask),
            "grammar_accept_ms_per_step_median": 1e3 * statistics.median(clock.accept),
            "in_step_ratio": con_ms / (con_ms - grammar_ms),
            "constrained_outputs_finished_and_valid_json": valid}


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
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--constraint", choices=("json_object", "schema"), default="schema")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    res = run(args)
    print(f"decode step, {args.batch} requests: free {res['free_step_ms_median']:.1f} ms, constrained "
          f"{res['constrained_step_ms_median']:.1f} ms: x{res['ratio']:.3f} (per-round median "
          f"x{res['per_round_ratio_median']:.3f}); in the grammar per step: mask "
          f"{res['grammar_mask_ms_per_step_median']:.2f} ms, accept {res['grammar_accept_ms_per_step_median']:.2f} ms "
          f"(in-step ratio x{res['in_step_ratio']:.4f}); load average {res['load_average_at_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
