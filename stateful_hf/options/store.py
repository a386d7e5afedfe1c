"""The session store's options, each declared once with a one-line doc:

- `StoreOptions`: the options of both stores, `KVStore(spec, device_capacity, **options)` and
  `SessionStore(model, device_capacity, **options)`;
- `SessionStoreOptions`: those plus what SessionStore reads from the model (chunk size, HCache's split);
- `StoreConfig`: those plus what a model-free `KVStore` is given instead (the hidden-state geometry,
  the projector, the model's fingerprint); `KVStore.config`, which `store_parts.assemble` builds from.

Each has its TypedDict of keyword arguments (`**options: Unpack[...]`; tests/test_options.py keeps their
keys equal to the fields, device_capacity aside: it is the stores' positional argument).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from .declare import Options, TokensOrSize, check_capacity, check_fraction, check_int, check_seconds, option
from .modes import HiddenStates, Layout, Mode

CAPACITIES = ("host_capacity", "disk_capacity", "hidden_capacity", "hidden_disk_capacity")   # None: the default


class DiskWrite(Mode):
    """When the disk tier gets a chunk's KV (docs/tiers.md, docs/durability.md)."""

    BEHIND = "behind"      # copied in the background once a turn ended (the serving copy stays above) and on eviction
    EVICT = "evict"        # only when the chunk is evicted to disk


@dataclass(frozen=True, kw_only=True)
class StoreOptions(Options):
    """The options of `KVStore` and `SessionStore` (their defaults). Checked at construction: a bad
    value raises ValueError naming the option; a mode's string becomes its enum member."""

    device_capacity: TokensOrSize = option(4096, "the device KV tier: tokens (an int) or a size such as '2GiB'",
                                           flag=True)
    host_capacity: TokensOrSize | None = option(
        None, "the host KV tier (tokens or a size); None: no host tier", flag=True,
        cli="the host KV tier: tokens or a size; none or 0: no host tier (memory is taken as it is used)")
    disk_dir: str | os.PathLike | None = option(
        None, "the disk tier's directory (persistent; one process per directory; it records the model's "
        "fingerprint and refuses another model's, docs/durability.md); None: no disk tier", flag=True,
        cli="the disk tier's directory (persistent; one process per directory; docs/durability.md); none: no disk "
        "tier")
    disk_capacity: TokensOrSize | None = option(None, "the disk tier (tokens or a size); None: 1GiB with disk_dir",
                                                flag=True, cli="the disk tier: tokens or a size; none: 1GiB with "
                                                "--disk-dir")
    policy: Any = option(None, "eviction policy: a name (recency_cost, return_aware, pensieve, lru: "
                         "stateful_hf.cache.eviction.policy) or an EvictionPolicy; None: recency_cost", flag=True,
                         metavar="NAME", cli="eviction policy (none: recency_cost)")
    cost_profile: Any = option(None, "Pensieve's Cost(l), a CostProfile, for a named policy; None: SessionStore "
                               "measures it on the model (once per geometry and device) if the policy uses it")
    attn_backend: str = option(
        "auto", "paged attention backend: auto, torch, cpu, triton, flashinfer, flash_attn; on CUDA auto takes the "
        "first of flashinfer, flash_attn, triton, torch that serves the store (not measured: docs/gpu.md); on the "
        "CPU a SessionStore's auto measures cpu (the C++ kernel) against torch once and gives the C++ kernel the "
        "sub-requests of the run lengths it wins (decodes), torch the rest (docs/cpu.md); resolved when the store "
        "is made (a forced one that cannot serve it raises then); KVStore's default: torch",
        flag=("--attention-backend", "--backend"), metavar="NAME", cli="paged attention backend; auto: on CUDA the "
        "first of flashinfer, flash_attn, triton, torch that serves the store (docs/gpu.md), on the CPU the C++ "
        "kernel for decodes where it measured faster (every step where torch never clearly was), torch for the "
        "rest (docs/cpu.md); cpu: the C++ kernel for every step")
    swap_out_threshold: float = option(0.25, "after a turn, chunks move to the host ahead of time while fewer "
                                       "than this share of device blocks is free")
    hidden_states: HiddenStates = option(
        HiddenStates.NEVER, "HCache: never (K/V only), always (chunks moving down from the device are kept as "
        "hidden states, captured as tokens are computed) or auto (always where a layer's hidden state is "
        "smaller than its K+V and the split keeps a hidden layer)", flag=True, metavar="MODE",
        cli="HCache: keep chunks moving down from the device as hidden states (auto: where a layer's hidden state "
        "is smaller than its K+V)")
    hidden_capacity: TokensOrSize | None = option(
        None, "room for hidden-state chunks (tokens or a size); None: host_capacity", flag=True,
        cli="room for hidden-state chunks: tokens or a size; none: --host-capacity")
    hidden_disk_capacity: TokensOrSize | None = option(
        None, "the disk tier's file of hidden-state chunks; None: disk_capacity")
    layout: Layout = option(Layout.PAGED, "paged (a pool of blocks) or virtual (vAttention: device_capacity "
                            "reserved as virtual memory, a contiguous slot of max_context tokens per session, "
                            "pages committed as sessions grow; dense kernels)")
    max_context: int | None = option(None, "tokens per slot of the virtual layout; None: the model's max "
                                     "positions (SessionStore; KVStore needs it with the virtual layout)")
    keep_freed: TokensOrSize = option("64MiB", "virtual layout: freed device pages kept committed for reuse "
                                      "(tokens or a size; zeroed when reused; store.reclaim() returns them)")
    map_ahead: bool = option(True, "virtual layout: a background thread maps the block each stepping session "
                             "grows into next, before the step that needs it")
    clock: Callable[[], float] = option(time.monotonic, "the time source of sessions' last activity, the "
                                        "policy's idle time (a virtual clock makes eviction reproducible)")
    layerwise_kv: bool = option(False, "LayerKV: engine steps may keep only some layers of a chunk on the device "
                                "and the rest on the host tier (needs host_capacity, the paged layout, the torch "
                                "backend and no hidden states)")
    emulate_async: bool | None = option(None, "run every copy to or from the device under the CPU async "
                                        "emulator (docs/gpu.md); None: STATEFUL_HF_EMULATE_ASYNC=1 in the "
                                        "environment")
    max_sessions: int | None = option(None, "sessions held at most: past it the least recently active idle ones "
                                      "are forgotten whole (their next turn is a new conversation; shared prefixes "
                                      "stay); None: no bound", flag=True)
    session_ttl: float | None = option(None, "seconds an idle session is held after its last activity, then "
                                       "forgotten whole; None: no limit", flag=True)
    max_retain: float = option(600.0, "the furthest ahead, in seconds, a session's expected next turn (a hint's "
                               "expected_arrival, an X-Session-Retain header) ranks it for eviction; longer ones "
                               "are clamped", flag=True)
    disk_write: DiskWrite = option(
        DiskWrite.BEHIND, "with a disk tier: behind (a background writer copies each session's chunks to disk "
        "write_behind_delay after its turn ended, keeping the serving copy on the device or host, so a restart "
        "finds them) or evict (a chunk reaches disk only when evicted there)")
    write_behind_delay: float = option(1.0, "seconds a finished turn waits before its chunks' disk copies are "
                                       "queued (a session that starts its next turn sooner waits again)", flag=True)
    write_behind_queue: TokensOrSize = option("64MiB", "the write-behind queue's cap (tokens or a size): chunks "
                                              "staged for disk at once; a copy that does not fit is skipped and "
                                              "counted, never waited for")
    prefix_sharing: bool | None = option(None, "full chunks of identical prefixes (same tenant and cache_salt) "
                                         "are held once (docs/prefix-sharing.md); None: on where it can be "
                                         "(the paged layout, no layerwise_kv)")

    def __post_init__(self) -> None:
        check_capacity("device_capacity", self.device_capacity)
        for name in CAPACITIES:
            if getattr(self, name) is not None:
                check_capacity(name, getattr(self, name))
        check_capacity("keep_freed", self.keep_freed, zero=True)
        check_capacity("write_behind_queue", self.write_behind_queue)
        object.__setattr__(self, "disk_write", DiskWrite.of("disk_write", self.disk_write))
        if isinstance(self.write_behind_delay, bool) or not isinstance(self.write_behind_delay, (int, float)) or \
                not 0 <= self.write_behind_delay < float("inf"):
            raise ValueError(f"write_behind_delay must be a number of seconds >= 0, got {self.write_behind_delay!r}")
        object.__setattr__(self, "write_behind_delay", float(self.write_behind_delay))
        check_fraction("swap_out_threshold", self.swap_out_threshold)
        check_int("max_context", self.max_context, 1, none="the model's")
        check_int("max_sessions", self.max_sessions, 1, none="no bound")
        object.__setattr__(self, "session_ttl", check_seconds("session_ttl", self.session_ttl))
        object.__setattr__(self, "max_retain", check_seconds("max_retain", self.max_retain))
        object.__setattr__(self, "hidden_states", HiddenStates.of("hidden_states", self.hidden_states))
        object.__setattr__(self, "layout", Layout.of("layout", self.layout))
        if not isinstance(self.attn_backend, str):
            raise ValueError(f"attn_backend must be a backend's name, got {self.attn_backend!r}")
        if self.disk_capacity is not None and self.disk_dir is None:
            raise ValueError("disk_capacity needs a disk_dir")
        if self.prefix_sharing and (self.layout is not Layout.PAGED or self.layerwise_kv):
            raise ValueError("prefix_sharing needs layout='paged' and no layerwise_kv (a virtual layout keeps each "
                             "session's KV in its own slot; layer-wise KV splits blocks among sessions)")


@dataclass(frozen=True, kw_only=True)
class SessionStoreOptions(StoreOptions):
    """`SessionStore`'s options: the stores' and what it reads from the model."""

    chunk_size: int = option(32, "tokens per chunk, the unit of movement (the pools' block size)", flag=True)
    hidden_layers: int | None = option(None, "HCache: layers kept as hidden states (the rest as K/V); None: "
                                       "the split a disk_dir recorded, else HCache's planner's")
    hidden_budget: float | None = option(0.55, "HCache: most bytes per token a hidden chunk may store, as a "
                                         "share of its K/V bytes (ignored where it cannot be met); None: the "
                                         "fastest restore whatever the size")
    hidden_costs: Any = option(None, "HCache: the per-layer costs the planner splits by (a HiddenCosts); None: "
                               "measured on the model")
    batch_invariant: bool | None = option(
        None, "every forward of the store's turns and steps runs under stateful_hf.batch_invariant(split="
        "chunk_size): K/V and logits bitwise equal to stateless generate under that context, whatever the batch, "
        "chunking, tier or threads (the CPU, the 'cpu' attention kernel; docs/cpu.md#batch-invariance); None: on "
        "for a bfloat16 or float16 model wherever the store can keep it, else off (SessionStore.invariant_off "
        "says why); True: on in any dtype, or a ValueError saying why not", flag=True,
        cli="batch invariance (docs/cpu.md#batch-invariance); default: on for bf16 and fp16 wherever the store "
        "can keep it (the CPU, full causal attention, a paged layout), off elsewhere and in float32")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, 1)
        check_int("hidden_layers", self.hidden_layers, 0, none="planned")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True, False or None (on where supported), got "
                             f"{self.batch_invariant!r}")
        if self.batch_invariant and (self.layerwise_kv or self.layout is not Layout.PAGED):
            raise ValueError("batch_invariant=True needs layout='paged' and no layerwise_kv (the 'cpu' attention "
                             "kernel reads the paged pool)")
        if self.batch_invariant and self.attn_backend not in ("auto", "cpu"):
            raise ValueError(f"batch_invariant=True attends with attn_backend='cpu' (the fixed-split kernel), not "
                             f"{self.attn_backend!r}")
        if self.hidden_budget is not None and (isinstance(self.hidden_budget, bool) or
                                               not isinstance(self.hidden_budget, (int, float)) or
                                               not self.hidden_budget > 0):
            raise ValueError(f"hidden_budget must be a share > 0 or None, got {self.hidden_budget!r}")


@dataclass(frozen=True, kw_only=True)
class StoreConfig(StoreOptions):
    """`KVStore`'s options: the stores' and what a model-free store is given instead of a model
    (`SessionStore` derives them). `KVStore.config` holds the backend it resolved."""

    hidden_spec: Any = option(None, "HCache: the hidden-state geometry (a HiddenSpec) a capturing store needs")
    project: Callable | None = option(None, "HCache: hidden state -> K/V of one layer (a Projector) a capturing "
                                      "store needs")
    disk_fingerprint: str = option("", "identifies the model whose KV the disk tier holds; a disk_dir made with "
                                   "another is refused")
    step_backends: Any = option(None, "the backend of each step (a kernels.StepBackends, its `long` the resolved "
                                "attn_backend) SessionStore measured for 'auto' on the CPU; None: attn_backend attends "
                                "every step")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is Layout.VIRTUAL and self.max_context is None:
            raise ValueError("layout='virtual' needs max_context (tokens per session slot)")


class StoreKwargs(TypedDict, total=False):
    """`StoreOptions`' fields as keyword arguments (device_capacity is the stores' positional argument)."""

    host_capacity: TokensOrSize | None
    disk_dir: str | os.PathLike | None
    disk_capacity: TokensOrSize | None
    policy: Any                     # a name or an EvictionPolicy
    cost_profile: Any               # a CostProfile
    attn_backend: str
    swap_out_threshold: float
    hidden_states: HiddenStates | str
    hidden_capacity: TokensOrSize | None
    hidden_disk_capacity: TokensOrSize | None
    layout: Layout | str
    max_context: int | None
    keep_freed: TokensOrSize
    map_ahead: bool
    clock: Callable[[], float]
    layerwise_kv: bool
    emulate_async: bool | None
    max_sessions: int | None
    session_ttl: float | None
    max_retain: float
    prefix_sharing: bool | None
    disk_write: DiskWrite | str
    write_behind_delay: float
    write_behind_queue: TokensOrSize


class SessionStoreKwargs(StoreKwargs, total=False):
    """`SessionStoreOptions`' fields as keyword arguments (device_capacity aside)."""

    chunk_size: int
    hidden_layers: int | None
    hidden_budget: float | None
    hidden_costs: Any               # a HiddenCosts
    batch_invariant: bool | None


class KVStoreKwargs(StoreKwargs, total=False):
    """`StoreConfig`'s fields as keyword arguments (device_capacity aside)."""

    hidden_spec: Any                # a HiddenSpec
    project: Callable | None        # a Projector
    disk_fingerprint: str
    step_backends: Any              # a StepBackends
