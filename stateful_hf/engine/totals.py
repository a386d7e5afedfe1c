"""`EngineStats`, what `Engine.stats()` returns, and the running totals it is read from (`StepTotals`): counts over
an engine's life, written by the stepping thread only (`Stepper`, under the engine's step lock)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import RequestOutput
    from .runner import StepRecord


@dataclass(frozen=True, slots=True)
class EngineStats:
    steps: int
    finished_requests: int
    prompt_tokens: int           # new prompt rows computed
    recomputed_tokens: int       # history rows recomputed (dropped or evicted KV)
    generated_tokens: int
    busy_seconds: float          # time spent in steps
    tokens_per_second: float     # generated tokens per busy second
    mean_batch_tokens: float
    mean_occupancy: float        # mean share of device blocks in use after a step
    running: int
    waiting: int
    # SLOs (zero without them): finished requests whose metric is defined, and those over the SLO.
    ttft_measured: int = 0
    ttft_slo_violations: int = 0
    ttft_slo_violation_rate: float = 0.0       # violations / measured
    tpot_measured: int = 0
    tpot_slo_violations: int = 0
    tpot_slo_violation_rate: float = 0.0
    slo_deferrals: int = 0                     # steps whose admission the TPOT slack gate stopped
    layered_admissions: int = 0                # prefills admitted with fewer than all layers on the device
    pushed_blocks: int = 0                     # device blocks freed by pushing running requests' layers down
    compile: str = ""                          # how the steps run: "inductor (...)" or "eager (the reason)"
    compiled_steps: int = 0                    # steps whose forward ran compiled
    quantization: str = ""                     # the model's quantized linear layers ("": none)
    linear: str = ""                           # the steps' linear kernel and why (prepack_weights' decision)


class StepTotals:
    """Counts over an engine's life. One writer: the stepping thread (under the engine's step lock)."""

    def __init__(self):
        self._t = Counter()

    @property
    def steps(self) -> int:
        return self._t["steps"]

    def add_step(self, record: StepRecord, decode_rows: int) -> None:
        """A committed step: `decode_rows` of its rows fed a sampled token of a decoding request."""
        t = self._t
        t["steps"] += 1
        t["prompt"] += sum(e[2] for e in record.entries) - decode_rows
        t["recomputed"] += sum(e[1] for e in record.entries)
        t["generated"] += sum(e[3] for e in record.entries)
        t["rows"] += record.num_tokens
        t["busy_us"] += int(record.seconds * 1e6)
        t["occupancy_ppm"] += int(1e6 * record.used_blocks / max(record.total_blocks, 1))

    def add_finished(self, out: RequestOutput) -> None:
        t, m = self._t, out.metrics
        t["finished"] += 1
        for name, violated in (("ttft", m.ttft_slo_violated), ("tpot", m.tpot_slo_violated)):
            if violated is not None:
                t[f"{name}_measured"] += 1
                t[f"{name}_violations"] += violated

    def stats(self, running: int, waiting: int, slo_deferrals: int, layered_admissions: int,
              pushed_blocks: int, compile: str = "", compiled_steps: int = 0) -> EngineStats:
        t = self._t
        busy = t["busy_us"] / 1e6
        return EngineStats(steps=t["steps"], finished_requests=t["finished"], prompt_tokens=t["prompt"],
                           recomputed_tokens=t["recomputed"], generated_tokens=t["generated"], busy_seconds=busy,
                           tokens_per_second=t["generated"] / busy if busy else 0.0,
                           mean_batch_tokens=t["rows"] / max(t["steps"], 1),
                           mean_occupancy=t["occupancy_ppm"] / 1e6 / max(t["steps"], 1),
                           running=running, waiting=waiting,
                           ttft_measured=t["ttft_measured"], ttft_slo_violations=t["ttft_violations"],
                           ttft_slo_violation_rate=t["ttft_violations"] / max(t["ttft_measured"], 1),
                           tpot_measured=t["tpot_measured"], tpot_slo_violations=t["tpot_violations"],
                           tpot_slo_violation_rate=t["tpot_violations"] / max(t["tpot_measured"], 1),
                           slo_deferrals=slo_deferrals, layered_admissions=layered_admissions,
                           pushed_blocks=pushed_blocks, compile=compile, compiled_steps=compiled_steps)
