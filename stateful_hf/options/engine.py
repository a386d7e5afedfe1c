"""The engine's own options, each declared once with a one-line doc: `SchedulingOptions` (the fields of
the scheduler's `SchedulerConfig`, `stateful_hf/engine/scheduler.py`) and `EngineConfig` (those plus the
engine's). `Engine(model, tokenizer, store, **options)` takes them and, for the store it makes, the
store's (`store.py`): `EngineKwargs`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from .declare import Options, TokensOrSize, check_fraction, check_int, check_known, check_seconds, option
from .modes import GenerationConfigMode, OnBusy, PrepackWeights
from .store import SessionStoreKwargs, SessionStoreOptions

STEP_THREADS = ("auto", "shrink")


@dataclass(frozen=True)
class SchedulingOptions(Options):
    """The scheduler's options (`SchedulerConfig` adds what it derives from them)."""

    max_batch_tokens: int = option(512, "rows per forward (prompt chunks, recomputed history, decode tokens); "
                                   "prefills are chunked to fit", flag=True)
    max_num_seqs: int = option(128, "running requests at most", flag=True)
    reserve_fraction: float = option(0.1, "admit new work only while more than this share of device blocks "
                                     "is available")
    short_prefill_tokens: int | None = option(
        None, "a turn with at most this many rows before its first token (a returning session's message) is "
        "served before long prefills; None: max_batch_tokens // 4; 0: arrival order")

    def __post_init__(self) -> None:
        check_int("max_batch_tokens", self.max_batch_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_fraction("reserve_fraction", self.reserve_fraction)
        check_int("short_prefill_tokens", self.short_prefill_tokens, 0, none="max_batch_tokens // 4")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulingOptions):
    """`Engine`'s own options (its defaults). Checked at construction: a bad value raises ValueError
    naming the option; a mode's string becomes its enum member."""

    on_busy: OnBusy = option(OnBusy.WAIT, "a submit for a session that has a turn in flight waits for it "
                             "(wait) or fails (refuse)")
    arrival_window: float = option(
        0.005, "seconds the background loop waits after a step that ended requests for their callers' next "
        "turns (at most a tenth of the step), and, woken from idle, while submissions keep coming; 0: never")
    keep_step_records: int = option(4096, "the last StepRecords kept (engine.steps)")
    ttft_slo: float | None = option(None, "seconds to a request's first token; None: no SLO (metrics and stats "
                                    "report violations)")
    tpot_slo: float | None = option(None, "seconds per output token; with it, queued prefills are admitted only "
                                    "while their predicted time fits the running decodes' smallest slack (slo.py)")
    min_kept_layers: int | None = option(None, "LayerKV (layerwise_kv): fewest layers a prefill keeps on the "
                                         "device; None: derived from profiled costs")
    release_openmp_pool: bool = option(True, "start() frees the calling thread's idle OpenMP workers, so the "
                                       "loop thread's pool spins like the main thread's (openmp.py)")
    step_threads: int | str | None = option(
        "auto", "the loop thread's OpenMP team (thread_sizing.py): auto (full team on a free host, sized to "
        "the free cores while it is busy), shrink (always sized to the free cores), an int, or None (torch's)")
    generation_config: GenerationConfigMode = option(
        GenerationConfigMode.AUTO, "where a request's unset sampling fields come from: auto (the model's "
        "generation config, then SamplingParams' defaults) or library (SamplingParams' defaults)")
    grammar_compile_timeout: float = option(
        5.0, "seconds a constrained request (SamplingParams.constraint) waits for its grammar to compile; "
        "longer fails the request (grammar.py); None: no limit")
    warm_ahead: float | None = option(
        0.25, "seconds before a session's expected turn (a hint's expected_arrival, X-Session-Retain) at which the "
        "engine brings its KV up to the device: lower tiers copied up, dropped chunks recomputed, as a "
        "lowest-priority warm-up that yields to any turn (warmup.py); None: never")
    prepack_weights: PrepackWeights = option(
        PrepackWeights.AUTO, "the steps multiply by MKL's (float32) or oneDNN's (bfloat16) packed copies of the "
        "linear weights, made once (extra memory about the weights' size): auto (where this CPU has a packed "
        "kernel for the model's dtype), on (an error where none), off (F.linear)")
    compile: bool | str = option(
        "auto", "the steps without per-layer work run through torch.compile (inductor, dynamic token count), "
        "compiled at engine start: True (an error where the model or store cannot compile), False (eager), auto "
        "(eager for now on the CPU and under batch invariance; the reason is in stats().compile)")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "on_busy", OnBusy.of("on_busy", self.on_busy))
        object.__setattr__(self, "generation_config",
                           GenerationConfigMode.of("generation_config", self.generation_config))
        object.__setattr__(self, "prepack_weights", PrepackWeights.of("prepack_weights", self.prepack_weights))
        check_fraction("arrival_window", self.arrival_window, " seconds")
        check_int("keep_step_records", self.keep_step_records, 0)
        object.__setattr__(self, "ttft_slo", check_seconds("ttft_slo", self.ttft_slo))
        object.__setattr__(self, "tpot_slo", check_seconds("tpot_slo", self.tpot_slo))
        object.__setattr__(self, "warm_ahead", check_seconds("warm_ahead", self.warm_ahead))
        object.__setattr__(self, "grammar_compile_timeout",
                           check_seconds("grammar_compile_timeout", self.grammar_compile_timeout))
        check_int("min_kept_layers", self.min_kept_layers, 0, none="derived")
        if not (self.compile is True or self.compile is False or self.compile == "auto"):
            raise ValueError(f"compile must be 'auto', True or False, got {self.compile!r}")
        t = self.step_threads
        if not (t is None or t in STEP_THREADS or (isinstance(t, int) and not isinstance(t, bool) and t >= 1)):
            raise ValueError(f"step_threads must be 'auto', 'shrink', an int >= 1 or None, got {t!r}")


class EngineConfigKwargs(TypedDict, total=False):
    """`EngineConfig`'s fields as keyword arguments."""

    max_batch_tokens: int
    max_num_seqs: int
    reserve_fraction: float
    short_prefill_tokens: int | None
    on_busy: OnBusy | str
    arrival_window: float
    keep_step_records: int
    ttft_slo: float | None
    tpot_slo: float | None
    min_kept_layers: int | None
    release_openmp_pool: bool
    step_threads: int | str | None
    generation_config: GenerationConfigMode | str
    grammar_compile_timeout: float
    prepack_weights: PrepackWeights | str
    compile: bool | str
    warm_ahead: float | None


class EngineKwargs(EngineConfigKwargs, SessionStoreKwargs, total=False):
    """`Engine`'s keyword arguments: its own options and those of the SessionStore it makes."""

    device_capacity: TokensOrSize


def split_engine_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine options, store options) of `Engine`'s keyword arguments; an unknown name raises TypeError
    naming the closest valid ones."""
    engine_names, store_names = EngineConfig.names(), SessionStoreOptions.names()
    check_known(options, (*engine_names, *store_names))
    return ({k: v for k, v in options.items() if k in engine_names},
            {k: v for k, v in options.items() if k in store_names})
