"""Environment, markdown tables and PNG plots of a benchmark run."""

from __future__ import annotations

import os
import platform

import torch
import transformers


def environment() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _mib(b: int | None) -> str:
    return "-" if not b else f"{b / 2**20:.1f}"


def table(systems: dict[str, dict]) -> str:
    head = ("| system | tok/s | req/s | tok/CPU-s | TTFT p50 s | TTFT p90 s | TTFT p99 s | norm. lat. mean s/tok | "
            "norm. lat. p90 | prefill computed | reused | recomputed | peak KV MiB (device/host/disk) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, m in systems.items():
        p = m["peak_kv_bytes"]
        peak = "/".join(_mib(p.get(t)) for t in ("device", "host", "disk")) + \
            (f" (+hidden {_mib(p['hidden'])})" if p.get("hidden") else "")
        rows.append(f"| {name} | {m['throughput_tok_s']:.2f} | {m['throughput_req_s']:.3f} | "
                    f"{m['tok_per_cpu_s']:.2f} | {m['ttft_p50_s']:.3f} | "
                    f"{m['ttft_p90_s']:.3f} | {m['ttft_p99_s']:.3f} | {m['norm_latency_mean_s']:.4f} | "
                    f"{m['norm_latency_p90_s']:.4f} | {m['prefill_computed_tokens']} | {m['reused_tokens']} | "
                    f"{m['recomputed_tokens']} | {peak} |")
    return "\n".join(rows)


def ratios(systems: dict[str, dict], ours: str = "stateful_hf") -> dict[str, dict]:
    """Throughput ratio (ours / theirs) and p90 TTFT reduction (theirs / ours) against each baseline."""
    if ours not in systems:
        return {}
    o = systems[ours]
    return {name: {"throughput_x": o["throughput_tok_s"] / m["throughput_tok_s"],
                   "ttft_p90_reduction_x": m["ttft_p90_s"] / o["ttft_p90_s"],
                   "norm_latency_mean_reduction_x": m["norm_latency_mean_s"] / o["norm_latency_mean_s"]}
            for name, m in systems.items() if name.startswith("hf_")}


def sharing_table(systems: dict[str, dict], kv_bytes_per_token: int) -> str:
    """--system-prompt: device tokens held at peak (sampled device KV bytes / KV bytes per token:
    physical, a shared chunk counts once), prompt tokens computed and reused, TTFT of first turns."""
    rows = ["| system | peak device tokens | prompt tokens computed | reused | first-turn TTFT mean (s) | p90 (s) |",
            "|---|---|---|---|---|---|"]
    for name, m in systems.items():
        first = m["ttft_by_turn_s"].get("0", {})
        dev = m["peak_kv_bytes"].get("device", 0) // max(kv_bytes_per_token, 1)
        rows.append(f"| {name} | {dev} | {m['prefill_computed_tokens']} | {m['reused_tokens']} | "
                    f"{first.get('mean', float('nan')):.3f} | {first.get('p90', float('nan')):.3f} |")
    return "\n".join(rows)


def ttft_by_turn_table(systems: dict[str, dict]) -> str:
    turns = sorted({int(k) for m in systems.values() for k in m["ttft_by_turn_s"]})
    rows = ["| system | " + " | ".join(f"turn {t}" for t in turns) + " |", "|---|" + "---|" * len(turns)]
    for name, m in systems.items():
        cells = [f"{m['ttft_by_turn_s'][str(t)]['mean']:.3f}" if str(t) in m["ttft_by_turn_s"] else "-"
                 for t in turns]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plots(out: dict, directory: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in out["systems"].items():
        turns = sorted(int(k) for k in m["ttft_by_turn_s"])
        ax.plot(turns, [m["ttft_by_turn_s"][str(t)]["mean"] for t in turns], marker="o", label=name)
    ax.set(xlabel="turn index", ylabel="mean TTFT (s, log scale)", title="TTFT by turn", yscale="log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    paths.append(_save(fig, directory, "ttft_by_turn.png"))
    if out.get("sweep"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, points in out["sweep"].items():
            pts = sorted(points, key=lambda p: p["rate_conv_s"])
            ax.plot([p["throughput_tok_s"] for p in pts], [p["norm_latency_mean_s"] for p in pts], marker="o",
                    label=name)
            for p in pts:
                ax.annotate(f"{p['rate_conv_s']:g}/s", (p["throughput_tok_s"], p["norm_latency_mean_s"]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set(xlabel="throughput (generated tokens/s)", ylabel="normalized latency (s/token)",
               title="throughput vs normalized latency (rate sweep)")
        ax.legend(fontsize=7)
        paths.append(_save(fig, directory, "throughput_vs_latency.png"))
    if out.get("policy"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = list(out["policy"]["systems"])
        ax.bar(names, [out["policy"]["systems"][n]["recomputed_tokens"] for n in names])
        ax.set(ylabel="recomputed tokens", title="eviction policy under memory pressure")
        paths.append(_save(fig, directory, "policy_recomputed.png"))
    return paths


def _save(fig, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def markdown(out: dict, plot_dir: str | None = None) -> str:
    """The README's performance section: command, setup, tables, ratios, policy, plots."""
    env, wl, arr = out["environment"], out["workload"], out["arrivals"]
    la = env.get("load_average_at_start")
    model = out["model"].get("described") or \
        f"{out['model']['params'] / 1e6:.1f}M-parameter Llama (random weights, float32)"
    lines = [
        f"`{out['command']}` — {model}, "
        f"{env['cpu']}, {env['cpu_count']} cores, {env['torch_threads']} torch threads, torch {env['torch']}, "
        f"transformers {env['transformers']}; load average {la[0]:.1f} at the start and "
        f"{out['load_average_at_end'][0]:.1f} at the end (a shared machine), {out['elapsed_s']:.0f} s in all.",
        "",
        f"Workload: {wl['conversations']} conversations, {wl['turns']} turns ({wl['source']}, lengths x{wl['scale']}: "
        f"{wl['mean_input_tokens']:.1f} input / {wl['mean_output_tokens']:.1f} output tokens per turn); "
        f"{arr['mode']}, think time exponential with mean {arr['think_time_mean_s']:g} s (Pensieve: 60 s; scaled "
        f"down for this CPU). Device KV budget {out['kv_budget_tokens']} tokens for every system; "
        "`_host`/`_disk`/`_hidden` add a lower tier of 4x that.",
        "",
        table(out["systems"]),
        "",
        "TTFT by turn index (mean, s):",
        "",
        ttft_by_turn_table(out["systems"]),
        "",
    ]
    for name, r in out["ratios_vs_baselines"].items():
        lines.append(f"- stateful_hf vs {name} (>1 = stateful_hf better): throughput **x{r['throughput_x']:.2f}**, "
                     f"p90 TTFT **x{r['ttft_p90_reduction_x']:.2f}** ({name}'s / ours), mean normalized latency "
                     f"x{r['norm_latency_mean_reduction_x']:.2f}.")
    same = out.get("same_tokens_as_stateless", {})
    if same:
        lines.append(f"- Identical greedy tokens to stateless generate: "
                     f"{', '.join(f'{k} {v:.0%}' for k, v in same.items() if k != 'hf_stateless')}.")
    if "policy" in out:
        p = out["policy"]
        wd = p.get("workload", {})
        lines.append(f"- Policy replay ({wd.get('conversations', '?')} conversations at the dataset's lengths x"
                     f"{wd.get('scale', 1)}, {p['turns']} turns served one at a time on a virtual clock, "
                     f"{p['budget_tokens']} device tokens, Cost(l) measured on the model above): the store's "
                     f"default policy (`{p.get('default_policy', 'pensieve')}`) recomputed "
                     f"{p['cost_aware_recomputed']} tokens, LRU {p['lru_recomputed']} "
                     f"({p['reduction']:+.1%} fewer with the default)"
                     + "".join(f", {label} {p[key]}" for key, label in (
                         ("return_aware_recomputed", "return-aware Cost(s, l) * P(return)"),
                         ("pensieve_recomputed", "Pensieve's Cost(l) / T"), ("oracle_recomputed", "offline oracle"))
                               if p.get(key) is not None) + ".")
    for name, pts in out.get("sweep", {}).items():
        lines.append(f"- Rate sweep, {name}: " + "; ".join(
            f"{q['rate_conv_s']:g} conv/s -> {q['throughput_tok_s']:.1f} tok/s at "
            f"{q['norm_latency_mean_s']:.3f} s/token"
            for q in sorted(pts, key=lambda q: q["rate_conv_s"])) + ".")
    for name, why in out.get("skipped", {}).items():
        lines.append(f"- Skipped {name}: {why}.")
    if plot_dir:
        lines += [""] + [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.join(plot_dir, os.path.basename(p))})"
                         for p in out.get("plots", [])]
    return "\n".join(lines)
