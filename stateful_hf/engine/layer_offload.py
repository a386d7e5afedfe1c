"""Layer-wise KV allocation (LayerKV §3.1), the scheduler's side: how many layers a prefill keeps on
the device, and when running requests' kept layers are pushed down to the host.

x_min: the fewest kept layers whose offload still hides behind the prefill,
    T_offload(L − x) = β · (L − x) · n · (2 · Hkv · D · bytes) / BW  ≤  T_prefill(n)
with BW a measured device -> host copy bandwidth and T_prefill(n) = Σ_chunks Cost(context) from the
store's cost profile (Pensieve's Cost(l), `profile/cost.py`). A prefill that does not fit with all layers
gets the smallest keep factor f (the most layers, x = floor(L / f) at least) whose blocks fit, with
x ≥ x_min; f = 0 (every layer on the host) when x_min = 0 and nothing else fits.

Free-block projection (eq. 5): F_{t+1} = F_t + R_t − A_t over the next `horizon` steps, with F_t the
available device blocks, R_t the blocks of running requests predicted to finish (their remaining
output, or the p90 of observed lengths with an SLO policy), A_t the blocks the running requests
will take (decode tokens crossing a chunk boundary, prefill chunks) at their keep factors. While
F_{t+1} falls under the reserve, the kept layers of the most recently admitted layered requests are
pushed down to the host; if that is not enough, whole requests' device chunks (latest first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ..cache.doors.engine import CapacityError, CostProfile, EngineStore, Place, StoreError, TurnNeeds, blocks_at_most
from ..kernels.blocks import blocks_for
from .request import Request, RequestStatus, Rows, WorkItem, chunk_needs, item_end, next_item, whole_item

if TYPE_CHECKING:
    from .slo import SloPolicy


def check_min_kept_layers(value, num_layers: int) -> int | None:
    """None (x_min from the profile) or an int x with 0 <= x <= num_layers."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= num_layers:
        raise ValueError(f"min_kept_layers must be an int in [0, {num_layers}] (the model's layers) or None, "
                         f"got {value!r}")
    return value


class LayerwisePolicy:
    """x_min and the keep factor of a prefill. `residue(factor, chunks)` is the store's count of
    device blocks `chunks` new chunks of that factor take."""

    def __init__(self, num_layers: int, layer_bytes_per_token: int, bandwidth: float, profile: CostProfile,
                 block_size: int, min_kept_layers: int | None = None, beta: float = 1.2, horizon: int = 4):
        if bandwidth <= 0 or beta <= 0 or horizon < 1:
            raise ValueError("LayerwisePolicy: bandwidth and beta must be > 0, horizon >= 1")
        self.num_layers, self.layer_bytes_per_token = num_layers, layer_bytes_per_token
        self.bandwidth, self.profile, self.block_size = bandwidth, profile, block_size
        self.min_kept_layers = check_min_kept_layers(min_kept_layers, num_layers)
        self.beta, self.horizon = beta, horizon
        self.layered_admissions = 0       # prefills admitted with fewer than all layers on the device
        self.pushed_blocks = 0            # device blocks freed by pushing kept layers down

    def prefill_seconds(self, n_tokens: int, start: int = 0) -> float:
        """T_prefill: Σ over the prompt's chunks of Cost(context the chunk attends to)."""
        bs, stop = self.block_size, start + n_tokens
        return sum(self.profile.cost(min(end, stop)) for end in range(start + bs, stop + bs, bs))

    def offload_seconds(self, layers: int, n_tokens: int) -> float:
        return self.beta * layers * n_tokens * self.layer_bytes_per_token / self.bandwidth

    def x_min(self, n_tokens: int, start: int = 0) -> int:
        if self.min_kept_layers is not None:
            return self.min_kept_layers
        if n_tokens <= 0:
            return 0
        per_layer = self.offload_seconds(1, n_tokens)
        hidden = math.floor(self.prefill_seconds(n_tokens, start) / per_layer + 1e-9)   # layers whose offload hides
        return max(0, self.num_layers - hidden)

    def factors(self, x_min: int) -> list[int]:
        """Keep factors whose every residue keeps >= x_min layers, most layers first (0 last)."""
        out = [f for f in range(1, self.num_layers + 1) if self.num_layers // f >= x_min]
        return out + ([0] if x_min == 0 else [])

    def choose(self, chunks: int, room: int, x_min: int, residue: Callable[[int, int], int],
               layered: bool = False) -> int | None:
        """The smallest keep factor (most layers kept) whose `chunks` fit in `room` blocks, or None.
        `layered`: factor 1 is not a choice (the caller knows all layers do not fit)."""
        for f in self.factors(x_min):
            if layered and f == 1:
                continue
            if residue(f, chunks) <= room:
                return f
        return None


def measured_policy(model, store: EngineStore, min_kept_layers: int | None) -> LayerwisePolicy:
    """LayerKV's policy with this machine's costs: the device -> host bandwidth of one layer's blocks
    and the prefill time model Σ Cost(context) of the store's cost profile (measured if it has none)."""
    from ..profile.cost import measure_cost_profile

    spec = store.spec
    profile = store.cost_profile or measure_cost_profile(model, spec)
    layer_bytes = spec.bytes_per_token // spec.num_layers        # K + V of one layer, one token
    return LayerwisePolicy(spec.num_layers, layer_bytes, store.offload_bandwidth(), profile,
                           spec.block_size, min_kept_layers)


residue_blocks = blocks_at_most      # the store's bound (stateful_hf/cache/turn.py)

@dataclass(frozen=True, slots=True)
class LayerFit:
    """`LayerwiseScheduling.layer_factor`'s verdict: the keep factor of an admission (None: nothing fits);
    `needs`, the store's answer after it moved the session's own device chunks to the host (None: none moved)."""

    factor: int | None
    needs: TurnNeeds | None = None


@dataclass(frozen=True, slots=True)
class PushDown:
    """`LayerwiseScheduling.push_down`'s verdict: `request`'s layers went down, `freed` device blocks; `needs`,
    the store's answer after; `factor`, the keep factor of the chunks it fills from now on (None: unchanged)."""

    request: Request
    freed: int
    needs: TurnNeeds
    factor: int | None


class LayerScheduling(Protocol):
    """The scheduler's layer-wise part, as the scheduler and admission call it: `AllLayers` (no
    `layerwise_kv`: every layer on the device; answers from the core and changes nothing) or
    `LayerwiseScheduling` (LayerKV), chosen once where the scheduler is made. A method changes the store
    only where its doc says so, and no request: requests change through the verdicts it returns
    (`LayerFit`, `PushDown`), which the scheduler applies."""

    room_hint: str          # appended to a "no device room" error: what else could serve the request
    recuts: bool            # after `begin`, admission may re-cut a WAITING item's rows to fewer recomputed ones

    @property
    def layered_admissions(self) -> int:
        """Prefills admitted with fewer than all layers on the device."""
        ...

    @property
    def pushed_blocks(self) -> int:
        """Device blocks freed by pushing kept layers down."""
        ...

    def refusal(self, r: Request, what: str, chunks: int) -> CapacityError | None:
        """The error to fail `r` with at submit, needing `chunks` chunks (more than the device pool holds;
        `what` says so), or None if some state of the pools serves it. Reads the store."""
        ...

    def project(self, running: list[Request], avail: int, reserve: int) -> list[PushDown]:
        """As a pass begins with `avail` device blocks: the push-downs that keep the next steps above the
        `reserve` (eq. 5). Moves the pushed requests' layers to the host."""
        ...

    def make_room(self, r: Request, item: WorkItem, need: int, avail: int,
                  later: list[Request]) -> tuple[WorkItem, list[PushDown]]:
        """Running `r`'s `item` needs `need` device blocks and `avail` are left: push down the running
        requests `later` than it (latest first), then `r` itself, until it fits. Returns the item to run
        (cut to keep no layer on the device if `r` was pushed) and the push-downs, in order, for the
        scheduler to apply before it weighs the item again. Moves their layers to the host."""
        ...

    def fit_host(self, r: Request, item: WorkItem, taken: int) -> WorkItem | None:
        """`item` as it fits the host slots left after `taken` by this pass: itself, cut, or None (it waits)."""
        ...

    def host_needed(self, r: Request, item: WorkItem) -> int:
        """Host slots `item`'s fills take."""
        ...

    def host_left(self, taken: int) -> int:
        """Host slots a step could still fill, less `taken` by this pass."""
        ...

    def layer_factor(self, r: Request, needs: TurnNeeds, rows: Rows, keep: int, held: int, room: int,
                     host_avail: int) -> LayerFit:
        """The keep factor admitting `r` takes (see `LayerwiseScheduling.layer_factor`). May move `r`'s idle
        session's device chunks to the host."""
        ...

    def committed(self, running: list[Request], items: list[WorkItem]) -> int:
        """Device blocks the running prefills will take after this step's `items`."""
        ...

    def host_committed(self, running: list[Request], items: list[WorkItem]) -> int:
        """Host slots the running layer-wise requests will fill after this step's `items`."""
        ...

    def future_blocks(self, r: Request, item: WorkItem) -> int:
        """Device blocks `r`'s prefill will take after `item`, beyond what `committed` counted."""
        ...

    def future_host(self, r: Request, item: WorkItem) -> int:
        """Host slots `r`'s turn will fill after `item`."""
        ...

    def use_cost_profile(self, profile: CostProfile) -> None:
        """The engine's corrected cost profile (the prefill time model of x_min)."""
        ...


class AllLayers:
    """The layer-wise part of an engine without `layerwise_kv`: every chunk keeps all layers on the device
    (keep factor 1), nothing is pushed down, no host slot is filled, nothing is counted."""

    room_hint = ", or serve it with layerwise_kv=True (layers that do not fit on the device live on the host tier)"
    recuts = True
    layered_admissions = 0
    pushed_blocks = 0

    def __init__(self, store: EngineStore):
        self.store = store

    def refusal(self, r: Request, what: str, chunks: int) -> CapacityError | None:
        bs, device = self.store.block_size, self.store.pool_sizes.device_blocks
        return CapacityError(
            f"{what} with all layers on the device, and the device pool holds {device} ({device * bs} tokens). "
            f"Raise device_capacity, or serve it with layerwise_kv=True (layer-wise KV: the layers that do not "
            f"fit live on the host tier; host_capacity of at least {chunks * bs} tokens)")

    def project(self, running: list[Request], avail: int, reserve: int) -> list[PushDown]:
        return []

    def make_room(self, r: Request, item: WorkItem, need: int, avail: int,
                  later: list[Request]) -> tuple[WorkItem, list[PushDown]]:
        return item, []

    def fit_host(self, r: Request, item: WorkItem, taken: int) -> WorkItem | None:
        return item

    def host_needed(self, r: Request, item: WorkItem) -> int:
        return 0

    def host_left(self, taken: int) -> int:
        return 0

    def layer_factor(self, r: Request, needs: TurnNeeds, rows: Rows, keep: int, held: int, room: int,
                     host_avail: int) -> LayerFit:
        return LayerFit(1)

    def committed(self, running: list[Request], items: list[WorkItem]) -> int:
        return 0

    def host_committed(self, running: list[Request], items: list[WorkItem]) -> int:
        return 0

    def future_blocks(self, r: Request, item: WorkItem) -> int:
        return 0

    def future_host(self, r: Request, item: WorkItem) -> int:
        return 0

    def use_cost_profile(self, profile: CostProfile) -> None:
        pass


class LayerwiseScheduling:
    """The scheduler's layer-wise decisions (LayerKV), the `LayerScheduling` the engine gives its scheduler with
    `layerwise_kv`. Collaborators: the store (chunks are moved to the host and kept layers offloaded through it),
    the policy (`layerwise`; its counters are written here), the step's token budget and the SLO policy; the
    scheduler passes its `running` list where a decision reads it. What an item does with each chunk is its
    request's `TurnNeeds` (`request.chunk_needs`). Changes no request: its moves come back as verdicts
    (`LayerFit`, `PushDown`) the scheduler applies."""

    room_hint = ""
    recuts = False          # the keep factor was chosen for the rows weighed

    def __init__(self, store: EngineStore, layerwise: LayerwisePolicy, max_batch_tokens: int, slo: SloPolicy | None):
        self.store, self.layerwise, self.max_batch_tokens, self.slo = store, layerwise, max_batch_tokens, slo

    @property
    def layered_admissions(self) -> int:
        return self.layerwise.layered_admissions

    @property
    def pushed_blocks(self) -> int:
        return self.layerwise.pushed_blocks

    def use_cost_profile(self, profile: CostProfile) -> None:
        self.layerwise.profile = profile

    def refusal(self, r: Request, what: str, chunks: int) -> CapacityError | None:
        """Refused iff even the sparsest keep factor x_min allows does not fit (admission.py's docstring)."""
        store, lw = self.store, self.layerwise
        sizes, bs = store.pool_sizes, store.block_size
        device, host = sizes.device_blocks, sizes.host_blocks
        keep = 0
        if r.session_id in store:            # the history the turn shares: already on some tier
            keep = min(store.match_prefix(r.session_id, r.prompt), len(r.prompt) - 1)
        new = chunks - blocks_for(keep, bs)
        x_min = lw.x_min(len(r.prompt) - keep, keep)
        sparsest = lw.factors(x_min)[-1]
        on_device = residue_blocks(sparsest, new)
        if new <= host and on_device <= device and chunks <= host + device - on_device:
            return None
        kept = lw.num_layers if sparsest == 1 else (0 if sparsest == 0 else lw.num_layers // sparsest)
        return CapacityError(
            f"{what}, {new} of them new, even with layer-wise KV: keeping {kept} of {lw.num_layers} layers on "
            f"the device (x_min = {x_min}) takes {on_device} of the {device} device blocks, and the rest needs host "
            f"slots ({host} in the host pool). Raise device_capacity or host_capacity")

    def make_room(self, r: Request, item: WorkItem, need: int, avail: int,
                  later: list[Request]) -> tuple[WorkItem, list[PushDown]]:
        pushed: list[PushDown] = []
        for q in reversed(later):
            if need <= avail:
                break
            pushed.append(self.push_down(q, full=True))
            avail += pushed[-1].freed
        if need > avail and r.factor != 0:
            pushed.append(self.push_down(r, full=True))
            item = replace(item, factor=0)
        return item, pushed

    def fit_host(self, r: Request, item: WorkItem, taken: int) -> WorkItem | None:
        if item.factor == 1 or self.host_needed(r, item) <= self.host_left(taken):
            return item
        return self.trim_to_host(r, item, self.host_left(taken))

    def host_needed(self, r: Request, item: WorkItem) -> int:
        """Host slots a layer-wise item's fills take (0 for an item keeping all layers)."""
        return 0 if item.factor == 1 else len(chunk_needs(item).fills)

    def host_left(self, taken: int) -> int:
        """Host slots a step could still fill: the store's available ones less `taken` by this pass."""
        return self.store.available_host_blocks() - taken

    def layer_factor(self, r: Request, needs: TurnNeeds, rows: Rows, keep: int, held: int, room: int,
                     host_avail: int) -> LayerFit:
        """Keep factor for admitting `r` (its whole remaining `rows` + one block of decode growth, with
        `needs` the store's answer for its turn, weighed against `room` blocks): 1 if all layers fit, else
        the most layers that fit with x >= x_min and host room for the rest, else None."""
        bs, lw = self.store.block_size, self.layerwise
        whole = whole_item(r, keep, rows)
        fills, swaps, in_place = needs.needs(item_end(whole), whole.factor)
        growth = 1 if (keep + len(rows.pending)) % bs == 0 else 0     # the first decode token opens a chunk
        if len(fills) + growth + len(swaps) + len(in_place) + held <= room:
            return LayerFit(1)
        # Not all layers fit: the new chunks keep some layers (x >= x_min) in residue blocks, the rest
        # on the host, and the history's host chunks are read in place (factor != 1), never copied up.
        x_min = lw.x_min(len(rows.pending) + len(rows.missing), keep)
        if len(fills) + growth > host_avail:
            return LayerFit(None)
        factor = lw.choose(len(fills) + growth, room - held - len(swaps), x_min, residue_blocks, layered=True)
        if factor is None and held and r.status is RequestStatus.WAITING \
                and len(fills) + growth + held <= host_avail \
                and lw.choose(len(fills) + growth, room - len(swaps), x_min, residue_blocks, layered=True) is not None:
            # a returning session's own device chunks crowd its new ones out: move them to the host
            # (the session is idle until its lease), where this turn reads them in place
            try:
                self.store.move(r.session_id, [k for k, p in enumerate(needs.places) if p is Place.DEVICE], "host")
            except StoreError:     # no host room after all (or the session just turned busy): wait
                return LayerFit(None)
            moved = self.store.turn_needs(r.session_id, r.prompt, r.cache_salt)
            return LayerFit(self.layer_factor(r, moved, rows, keep, 0, room, host_avail - held).factor, moved)
        if factor is not None:
            lw.layered_admissions += 1
        return LayerFit(factor)

    def future_blocks(self, r: Request, item: WorkItem) -> int:
        """Device blocks r's prefill will still take after `item` (at its keep factor)."""
        rest = len(r.pending) + len(r.missing) - item.num_tokens
        return residue_blocks(r.factor, blocks_for(max(rest, 0), self.store.block_size))

    def committed(self, running: list[Request], items: list[WorkItem]) -> int:
        """Blocks the running prefills will take after this step's items: not free for admissions."""
        mine = {it.request.request_id: it for it in items}
        total = 0
        for q in running:
            it = mine.get(q.request_id)
            rest = len(q.pending) + len(q.missing) - (it.num_tokens if it is not None else 0)
            if not q.decoding and rest > 0:
                total += residue_blocks(q.factor, blocks_for(rest, self.store.block_size))
        return total

    def future_host(self, r: Request, item: WorkItem) -> int:
        """Host slots r's layer-wise turn will still fill after `item`: its remaining prompt chunks and
        the chunk its first decode token may open (0 for a request keeping all layers)."""
        if r.factor == 1:
            return 0
        rest = len(r.pending) + len(r.missing) - item.num_tokens
        return blocks_for(max(rest, 0), self.store.block_size) + 1

    def host_committed(self, running: list[Request], items: list[WorkItem]) -> int:
        """Host slots the running layer-wise requests will still fill after this step's items: not
        free for admissions (as `committed` is for device blocks)."""
        mine = {it.request.request_id: it for it in items}
        total = 0
        for q in running:
            if q.factor == 1:
                continue
            it = mine.get(q.request_id)
            rest = len(q.pending) + len(q.missing) - (it.num_tokens if it is not None else 0)
            total += blocks_for(max(rest, 0), self.store.block_size) + 1
        return total

    def trim_to_host(self, r: Request, item: WorkItem, slots: int) -> WorkItem | None:
        """`item` cut to the rows whose new chunks fit in `slots` host slots (None if no row does):
        rows up to the next chunk boundary need none, each further chunk one."""
        if item.recompute or slots < 0:
            return None
        bs = self.store.block_size
        rows = (-item.start) % bs + slots * bs
        if rows <= 0:
            return None
        cut = next_item(r, min(rows, len(item.new_ids)), item.start, bs)
        if cut is None or self.host_needed(r, replace(cut, factor=item.factor)) > slots:
            return None
        return replace(cut, factor=item.factor)

    def push_down(self, q: Request, full: bool) -> PushDown:
        """Push a running request's kept layers (and with `full` its device chunks) to the host; its
        later chunks keep no layer on the device."""
        freed = self.store.offload_layers(q.session_id, full=full)
        self.layerwise.pushed_blocks += freed
        return PushDown(q, freed, self.store.turn_needs(q.session_id), 0 if full or q.factor >= 2 else None)

    def project(self, running: list[Request], avail: int, reserve: int) -> list[PushDown]:
        """Eq. 5 over `horizon` steps: F = avail + R (blocks of requests predicted to finish) − A
        (blocks the running requests will take). While F < reserve, push down the kept layers of
        the most recently admitted layer-wise requests. Returns what it pushed down."""
        h, bs = self.layerwise.horizon, self.store.block_size
        budget = self.max_batch_tokens
        released = allocated = 0.0
        for q in running:
            n = q.length
            left = q.sampling.max_new_tokens - len(q.output_ids)
            if self.slo is not None:
                left = min(left, max(self.slo.outputs.predict_total(q.session_id, q.sampling.max_new_tokens)
                                     - len(q.output_ids), 1))
            if q.output_ids and left <= h:
                released += self.store.held_blocks(q.session_id)
            rows = min(left, h) if q.decoding else min(len(q.pending) + len(q.missing), h * budget)
            allocated += residue_blocks(q.factor, (n + rows - 1) // bs - (n - 1) // bs if n else blocks_for(rows, bs))
        projected, pushed = avail + released - allocated, []
        for q in reversed(running):               # most recently admitted first
            if projected >= reserve:
                break
            if q.needs is not None and Place.LAYERED in q.needs.places:   # it may hold residue blocks
                pushed.append(self.push_down(q, full=False))
                projected += pushed[-1].freed
        return pushed
