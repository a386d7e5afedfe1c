"""vLLM's metric names on /metrics, so that a dashboard built for vLLM reads this server.

`VLLM_METRICS` is a hand-written list pinned to one vLLM version (`VLLM_VERSION`: the metrics its
`vllm/v1/metrics/loggers.py` registers with Prometheus), each name with vLLM's type and its twin here:
the `stateful_hf_*` family whose samples it repeats. A twin is not a second writer: its samples are the
twin family's, copied at exposition (`twins`, called by `exposition.render`) under vLLM's name, with
vLLM's labels `model_name` (the served model, from `stateful_hf_model_info`) and `engine` (the
replica); `finish_reason` is spelled `finished_reason`, as vLLM's. `vllm:kv_cache_usage_perc` is a
ratio of two twins (the device tier's tokens over its capacity).

Where the meaning differs from vLLM's, docs/observability.md ("vLLM's names") says how.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vllm-project/vllm, vllm/v1/metrics/loggers.py (PrometheusStatLogger) at this commit
VLLM_VERSION = "vllm-project/vllm@005a810bc40faa25b8870fbc8559c3462581eee3"
MODEL_INFO = "stateful_hf_model_info"        # RouterMetrics' gauge {model_name} = 1: the served model
LABELS = {"replica": "engine", "finish_reason": "finished_reason"}      # ours -> vLLM's


@dataclass(frozen=True, slots=True)
class VllmMetric:
    """vLLM's `name` and `type`, repeating the samples of `twin` (a stateful_hf family) whose labels
    include `where`, less those whose labels include `drop`; with `over`, each value divided by the
    sample of family `over` with the same labels (0 where that is 0)."""

    name: str
    type: str
    twin: str
    help: str
    where: dict[str, str] = field(default_factory=dict)
    drop: dict[str, str] = field(default_factory=dict)
    over: str | None = None


VLLM_METRICS: tuple[VllmMetric, ...] = (
    VllmMetric("vllm:num_requests_running", "gauge", "stateful_hf_requests_running",
               "Requests running in the engine (stateful_hf_requests_running)"),
    VllmMetric("vllm:num_requests_waiting", "gauge", "stateful_hf_requests_waiting",
               "Requests queued in the engine (stateful_hf_requests_waiting)"),
    VllmMetric("vllm:kv_cache_usage_perc", "gauge", "stateful_hf_tier_tokens",
               "Device KV tier usage, 1 = full (stateful_hf_tier_tokens / stateful_hf_tier_capacity_tokens, "
               "tier device)", where={"tier": "device"}, over="stateful_hf_tier_capacity_tokens"),
    VllmMetric("vllm:prefix_cache_queries", "counter", "stateful_hf_prompt_tokens",
               "Prompt tokens looked up in stored KV (stateful_hf_prompt_tokens_total)"),
    VllmMetric("vllm:prefix_cache_hits", "counter", "stateful_hf_reused_tokens",
               "Prompt tokens served from stored KV, any tier (stateful_hf_reused_tokens_total)"),
    VllmMetric("vllm:prompt_tokens", "counter", "stateful_hf_prompt_tokens",
               "Prompt tokens of finished requests (stateful_hf_prompt_tokens_total)"),
    VllmMetric("vllm:generation_tokens", "counter", "stateful_hf_generation_tokens",
               "Generated tokens (stateful_hf_generation_tokens_total)"),
    VllmMetric("vllm:request_success", "counter", "stateful_hf_requests",
               "Finished requests by finished_reason, errors left out (stateful_hf_requests_total)",
               drop={"finish_reason": "error"}),
    VllmMetric("vllm:time_to_first_token_seconds", "histogram", "stateful_hf_time_to_first_token_seconds",
               "Arrival to first token (stateful_hf_time_to_first_token_seconds)"),
    VllmMetric("vllm:time_per_output_token_seconds", "histogram", "stateful_hf_time_per_output_token_seconds",
               "Mean time per output token after the first, per request "
               "(stateful_hf_time_per_output_token_seconds)"),
    VllmMetric("vllm:e2e_request_latency_seconds", "histogram", "stateful_hf_e2e_request_latency_seconds",
               "Arrival to last token (stateful_hf_e2e_request_latency_seconds)"),
    VllmMetric("vllm:request_queue_time_seconds", "histogram", "stateful_hf_request_queue_time_seconds",
               "Arrival to first scheduled (stateful_hf_request_queue_time_seconds)"),
)


def _served_model(fams: list[dict]) -> str | None:
    info = next((f for f in fams if f["name"] == MODEL_INFO), None)
    return None if info is None or not info["samples"] else info["samples"][0][1]["model_name"]


def _has(labels: dict, want: dict) -> bool:
    return all(labels.get(k) == v for k, v in want.items())


def twins(fams: list[dict]) -> list[dict]:
    """The vLLM families of `VLLM_METRICS` over `fams` (plain-data families, `exposition.families`), for
    the model `stateful_hf_model_info` names; none without it (no served model: a bare router). A twin
    family absent from `fams` gives no vLLM family (what no code feeds is not shown as zero)."""
    model = _served_model(fams)
    if model is None:
        return []
    by_name = {f["name"]: f for f in fams}
    out = []
    for m in VLLM_METRICS:
        src = by_name.get(m.twin)
        if src is None:
            continue
        if src["type"] != m.type:
            raise ValueError(f"{m.name} is a {m.type} in vLLM; its twin {m.twin} is a {src['type']}")
        over = {}
        if m.over is not None and m.over in by_name:
            over = {tuple(sorted(ls.items())): v for _, ls, v in by_name[m.over]["samples"]}
        samples = []
        for name, labels, value in src["samples"]:
            if not _has(labels, m.where) or (m.drop and _has(labels, m.drop)):
                continue
            if m.over is not None:
                den = over.get(tuple(sorted(labels.items())), 0.0)
                value = value / den if den else 0.0
            kept = {LABELS.get(k, k): v for k, v in labels.items() if k not in m.where}
            samples.append([m.name + name.removeprefix(m.twin), {"model_name": model, "engine": "0", **kept}, value])
        out.append({"name": m.name, "type": m.type, "help": m.help, "samples": samples})
    return out
