"""Figures of one run, the way Pensieve §6 and Symphony §5 report them."""

from __future__ import annotations

import statistics

from .driver import RunResult


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(res: RunResult) -> dict:
    recs = res.records
    out_tokens = sum(len(r.tokens) for r in recs)
    makespan = max((r.end for r in recs), default=0.0)
    ttft = [r.first_token - r.arrival for r in recs]
    norm = [(r.end - r.arrival) / len(r.tokens) for r in recs]
    prompt = sum(r.prompt_len for r in recs)
    reused = sum(r.reused for r in recs)
    by_turn: dict[int, list[float]] = {}
    for r, t in zip(recs, ttft):
        by_turn.setdefault(r.turn, []).append(t)
    m = {
        "requests": len(recs), "output_tokens": out_tokens, "wall_s": res.wall_s, "makespan_s": makespan,
        "throughput_tok_s": out_tokens / makespan if makespan else 0.0,
        "throughput_req_s": len(recs) / makespan if makespan else 0.0,
        "cpu_s": res.cpu_s,                              # process CPU time: robust to other load on the machine
        "tok_per_cpu_s": out_tokens / res.cpu_s if res.cpu_s else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "norm_latency_mean_s": statistics.fmean(norm) if norm else float("nan"),
        "norm_latency_p90_s": percentile(norm, 90),
        "prompt_tokens": prompt,
        "reused_tokens": reused,                         # history KV served (device hit, swap-in, hidden, shared block)
        "prefill_computed_tokens": prompt - reused,      # prompt rows run through the model (incl. recomputed history)
        "recomputed_tokens": res.info.get("recomputed_tokens", 0),
        "ttft_by_turn_s": {str(k): {"n": len(v), "mean": statistics.fmean(v), "p50": percentile(v, 50),
                                    "p90": percentile(v, 90)} for k, v in sorted(by_turn.items())},
        "peak_kv_bytes": dict(res.peak_bytes),
    }
    m.update({k: v for k, v in res.info.items() if k != "recomputed_tokens"})
    return m


def outputs(res: RunResult) -> dict[tuple[str, int], list[int]]:
    return {(r.conv_id, r.turn): r.tokens for r in res.records}


def agreement(a: RunResult, b: RunResult) -> float:
    """Share of turns whose generated tokens are identical in both runs."""
    oa, ob = outputs(a), outputs(b)
    keys = set(oa) | set(ob)
    return sum(oa.get(k) == ob.get(k) for k in keys) / max(len(keys), 1)
