"""`Engine`: many sessions served together; one forward per step mixes prompt chunks, recomputed
history and decode tokens. Submit from any thread; steps run on a background loop (`start()`) or,
without one, in whichever thread waits on a handle."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import torch

from ..cache.doors.engine import EngineStore, SessionBusyError, UnknownSessionError
from ..integration.checks import check_input_ids
from ..integration.session_store import SessionStore
from ..options import (
    EngineConfig,
    EngineKwargs,
    GenerationConfigMode,
    OnBusy,
    PrepackWeights,
    Unpack,
    split_engine_options,
)
from ..profile.correction import CostCorrection, StepRows
from . import frontends
from .admission import refusal
from .frontends import Conversations
from .hints import Hint, Prefetcher
from .layer_offload import AllLayers, LayerwiseScheduling, measured_policy
from .openmp import release_thread_pool
from .registry import RequestRegistry
from .request import Request, RequestHandle, RequestOutput
from .runner import ModelRunner, StepRecord, packed_weights
from .sampling import SamplingParams, eos_ids, make_generator
from .scheduler import Scheduler, SchedulerConfig
from .slo import SloPolicy
from .step_loop import StepLoop
from .stepper import Stepper
from .text import OutputText
from .thread_sizing import ThreadSizer
from .throwaway import ThrowawaySessions
from .totals import EngineStats
from .warmup import WarmUps


class Engine:
    """Serve many sessions of one model.

    `store`: a SessionStore of this model; None: the engine makes one from the store options given
    here (`device_capacity` defaults to 1GiB). The options are `EngineConfig`'s (the engine's and its
    scheduler's) and, for the store it makes, `SessionStoreOptions`' (`stateful_hf/options/`; each
    declared once with its default and a one-line doc; docs/engine.md explains the scheduling ones):
    an unknown one raises TypeError naming the closest valid ones, a bad value ValueError naming it.
    `layerwise_kv` is both: it makes a LayerKV store and turns on the engine's LayerKV scheduling
    (`layer_offload.py`), which needs a store made with it. `engine.config` holds the engine's options.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, store: SessionStore | None = None,
                 **options: Unpack[EngineKwargs]):
        engine_options, store_options = split_engine_options(dict(options))
        c = self.config = EngineConfig.build(**engine_options)
        layerwise_kv = bool(store_options.get("layerwise_kv", False))
        if c.min_kept_layers is not None and not layerwise_kv:
            raise ValueError("min_kept_layers needs layerwise_kv=True")
        if store is None:
            if c.prepack_weights is PrepackWeights.ON:      # the engine's packed GEMMs: not the invariant ones
                store_options.setdefault("batch_invariant", False)
            store = SessionStore(model, store_options.pop("device_capacity", "1GiB"), **store_options)
        else:
            given = sorted(set(store_options) - {"layerwise_kv"})
            if given:
                raise ValueError(f"{given[0]} is a store option: pass it to the SessionStore you give")
        self.arrival_window = c.arrival_window
        self.generation_config = getattr(model, "generation_config", None) \
            if c.generation_config is GenerationConfigMode.AUTO else None
        self.default_sampling = SamplingParams.from_generation_config(self.generation_config)
        self.ttft_slo, self.tpot_slo = c.ttft_slo, c.tpot_slo
        # None when no SLO is set: admission weighs tokens and blocks only
        self.slo = SloPolicy(c.ttft_slo, c.tpot_slo) if (c.ttft_slo, c.tpot_slo) != (None, None) else None
        self.store = store
        door: EngineStore = store      # the engine's parts see the store through its door (mypy: SessionStore keeps it)
        if self.store.model is not model:
            raise ValueError("the store belongs to another model")
        if layerwise_kv and not self.store.layerwise:
            raise ValueError("layerwise_kv=True needs a store made with layerwise_kv=True (or let the engine make it)")
        self.layerwise = measured_policy(model, door, c.min_kept_layers) if layerwise_kv else None
        self.model, self.tokenizer, self.on_busy = model, tokenizer, c.on_busy
        self.release_openmp_pool = c.release_openmp_pool
        self.adapter = self.store.adapter
        self.eos = eos_ids(model)
        layers = LayerwiseScheduling(door, self.layerwise, c.max_batch_tokens, self.slo) \
            if self.layerwise is not None else AllLayers(door)
        self.scheduler = Scheduler(door, SchedulerConfig(c.max_batch_tokens, c.max_num_seqs, c.reserve_fraction,
                                                               c.short_prefill_tokens),
                                   self.adapter.max_positions, self.slo, layers)
        packed, self.linear = packed_weights(model, c.prepack_weights, c.max_batch_tokens,
                                             self.store.invariant_split is not None)
        self.runner = ModelRunner(model, door, packed, compile=c.compile)
        self.thread_sizer = ThreadSizer.for_option(c.step_threads)
        self.loop = StepLoop(self.step, self.has_work, self._fail_in_flight,
                             release_thread_pool if c.release_openmp_pool else None,
                             self.thread_sizer.claim if self.thread_sizer is not None else None,
                             self._await_next_turns if c.arrival_window > 0 else None,
                             on_wake=self._gather_burst if c.arrival_window > 0 else None,
                             wake_in=lambda: self.warmups.wake_in())
        self.throwaway = ThrowawaySessions(door, self.loop.cv)
        self.requests = RequestRegistry(self.loop, self.throwaway.forget)
        self.warmups = WarmUps(door, self.requests, c.warm_ahead)
        base = door.cost_profile or (self.layerwise.profile if self.layerwise is not None else None)
        self.cost = CostCorrection(base, door.block_size) if base is not None else None
        self._moves_listener: Callable[[], None] | None = None     # unsubscribes; None while not subscribed
        self._listen_to_moves()
        self.stepper = Stepper(self.scheduler, self.runner, self.requests, self.eos, self.slo, self.ttft_slo,
                               self.tpot_slo, c.keep_step_records,
                               self.thread_sizer.fit if self.thread_sizer is not None else None,
                               before_step=self._before_step, observe_cost=self._observe_cost if base else None)
        self.steps = self.stepper.records          # the last `keep_step_records` StepRecords
        self.chats = Conversations(self.submit, self.requests.when_finished, tokenizer)
        self.hints = Prefetcher(self)

    @property
    def condition(self) -> threading.Condition:
        """Guards the registry and every handle's published state; notified after every step."""
        return self.loop.cv

    # ---- submitting -----------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: ids (list / 1-D or [1, n] tensor), a string, or chat messages."""
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("text or chat-message prompts need a tokenizer: Engine(model, tokenizer=...)")
            if isinstance(prompt, str):
                return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            return list(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True,
                                                           tokenize=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise ValueError("empty prompt: no token ids")
        return check_input_ids(prompt, self.adapter)

    def sampling_params(self, **explicit) -> SamplingParams:
        """SamplingParams with the fields given here (pass only the caller's explicit ones), the rest
        from the model's generation config (generation_config="auto"), then SamplingParams' defaults."""
        return SamplingParams.from_generation_config(self.generation_config, **explicit)

    def submit(self, session_id: str | None, prompt, sampling: SamplingParams | None = None, *,
               cache_salt: str | None = None, tenant: str | None = None) -> RequestHandle:
        """Queue one turn: `prompt` is the whole conversation (ids, text or messages). Never raises for
        a bad prompt or a busy session: the error is on the returned handle (`result()` raises it).
        `sampling` None: `default_sampling` (the model's generation config, then library defaults).
        `session_id` None: the turn runs in a throwaway session of `tenant` (`throwaway_session`),
        deleted when the turn ends; the handle's `session_id` names it. `tenant` is for throwaway
        sessions only (a named session's tenant is part of its key, `cache.session_key`).
        `cache_salt` (vLLM's): scopes prefix sharing within the tenant (docs/prefix-sharing.md)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        if session_id is None:
            session_id = self.throwaway_session(tenant)
        elif tenant is not None:
            raise ValueError("tenant= names the tenant of a throwaway session (session_id=None); a named "
                             "session's tenant is part of its key (stateful_hf.cache.session_key)")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
        sampling = sampling or self.default_sampling
        handle = self.requests.new_handle(session_id)
        r = Request(handle.request_id, session_id, [], sampling, None, cache_salt=cache_salt)
        try:
            r.bind(check_input_ids(self.encode(prompt), self.adapter), make_generator(sampling, self.store.spec.device),
                   OutputText(self.tokenizer, sampling.stop, sampling.skip_special_tokens)
                   if self.tokenizer is not None or sampling.stop else None)
            if sampling.constraint is not None:      # structured output (grammar.py: imported only here)
                from .grammar import constrain
                constrain(r, self.tokenizer, self.eos, self.config.grammar_compile_timeout)
        except (ValueError, TypeError) as e:
            return self.requests.reject(handle, r, e, self.stepper.output)
        never = refusal(self.store, self.scheduler.layers, r)      # before it takes anything (admission.py)
        if never is not None:
            return self.requests.reject(handle, r, never, self.stepper.output)

        # a warm-up of the session ends; this turn goes next
        warming = session_id in self.warmups.in_flight and self.warmups.yield_to(session_id)

        def refuse(active_here: bool) -> bool:
            return self.on_busy is OnBusy.REFUSE and not warming and (active_here or self.store.is_busy(session_id))

        if not self.requests.add(r, handle, refuse):
            return self.requests.reject(handle, r, SessionBusyError(session_id), self.stepper.output)
        return handle

    def throwaway_session(self, tenant: str | None = None) -> str:
        """A fresh session key of `tenant` (default: the default tenant) that the engine deletes when
        the last turn submitted for it ends (or is refused). `submit(None, ...)` uses one; a caller that
        needs the key before submitting (to watch its moves) takes one here and submits with it."""
        return self.throwaway.new(tenant)

    # ---- stepping -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.requests.has_inbox() or self.scheduler.has_work() or self._warm_due()

    def _warm_due(self) -> bool:
        """Whether a warm-up may be due (`warmup.py`); attribute reads, so a step without one runs nothing there."""
        w = self.warmups
        return w.ahead is not None and self.store.clock() + w.ahead >= w.next_at

    def _before_step(self) -> None:
        """Submit the warm-ups due now, before each step."""
        if self._warm_due():
            self.warmups.submit_due()

    def _observe_cost(self, rows: StepRows, seconds: float) -> None:
        """A step's time against the cost profile: a correction (`profile/correction.py`) goes to the store's
        eviction policy and to LayerKV's policy (stepping thread)."""
        assert self.cost is not None
        profile = self.cost.observe(rows, seconds)
        if profile is not None:
            self.store.use_cost_profile(profile)
            self.scheduler.layers.use_cost_profile(profile)

    def step(self) -> StepRecord | None:
        """Run one engine iteration (admit, schedule, forward, sample, publish; `stepper.py`). Returns what ran."""
        return self.stepper.step()

    # ---- background loop (step_loop.py: StepLoop) -------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.loop.running

    def start(self) -> Engine:
        """Start the background loop (idempotent). With `release_openmp_pool`, the calling thread's
        idle OpenMP workers are released first: alive, they make the loop's pool run throttled."""
        self._listen_to_moves()
        self.loop.start()
        return self

    def warm_up(self, tokens: int = 8, new_tokens: int = 2) -> None:
        """One throwaway turn of `tokens` ids and `new_tokens` generated through the running loop, then its totals
        forgotten: the loop thread's first step pays its one-time set-up (~20-40 ms on the tiny model, 4-7 ms
        later: allocations, kernel plans, the thread team) before a request does. With a thread sizer, the team is
        then decided from the host (`ThreadSizer.settle`) and the turn runs again in it. A server calls it before
        it answers /health, so a restarted process's first returning turn does not pay it."""
        prompt, sp = list(range(3, 3 + tokens)), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        self.submit(None, prompt, sp).result()
        if self.thread_sizer is not None:      # the team decided from the host now, its first steps paid here
            self.thread_sizer.settle()
            self.submit(None, prompt, sp).result()
        self.stepper.forget_totals()

    def _listen_to_moves(self) -> None:
        """Swap-ins timed by the store's moves feed the cost correction (correction.py) while the engine runs."""
        if self.cost is not None and self._moves_listener is None:
            door: EngineStore = self.store
            self._moves_listener = door.moves.subscribe(self.cost.observe_move)

    def stop(self, cancel: bool = False, timeout: float | None = None, flush: float | None = 10.0) -> None:
        """Stop the loop after the requests in flight finish (or are cancelled, with `cancel`); then, with a disk
        tier, write what is not on disk yet within `flush` seconds (`KVStore.flush`; None: write nothing), so a
        restart on the same disk keeps the live sessions."""
        if cancel:
            self.requests.cancel_all()
        self.loop.stop(timeout)
        if self._moves_listener is not None:      # a stopped engine's correction no longer hears the store
            self._moves_listener()
            self._moves_listener = None
        if flush is not None:
            self.store.flush(flush)
        if self.thread_sizer is not None:
            self.thread_sizer.close()

    def _fail_in_flight(self, error: Exception) -> None:
        self.stepper.fail_in_flight(error)

    def _await_next_turns(self) -> None:
        """The loop thread, after a step: if it ended requests, their callers' next turns usually follow
        at once (a chat client submits the next message when the answer is complete). Wait up to
        `arrival_window` (at most a tenth of the step just run) for as many submissions, so they join
        the next step instead of waiting out a whole one; the wait ends as soon as they are in."""
        if self.stepper.ended and self.stepper.last_seconds > 0:
            self.requests.await_arrivals(self.stepper.ended, min(self.arrival_window, 0.1 * self.stepper.last_seconds))

    def _gather_burst(self) -> None:
        """The loop thread, woken from idle by a submission: others often follow within a millisecond
        (clients that start together, a server's accepted batch). Wait while they keep coming, up to
        `arrival_window`, so the first step takes them together instead of running the first alone
        and the rest one step later; the burst ends after a fifth of the window without a submission
        (1 ms at the default), which is all a lone request waits."""
        self.requests.await_burst(self.arrival_window / 5, self.arrival_window)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(cancel=exc[0] is not None)

    # ---- convenience ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        layers = self.scheduler.layers
        stats = self.stepper.totals.stats(len(self.scheduler.running), len(self.scheduler.waiting),
                                          self.slo.deferred if self.slo is not None else 0,
                                          layers.layered_admissions, layers.pushed_blocks,
                                          *self.runner.compile_stats())
        quant = self.store.quantization
        return dataclasses.replace(stats, linear=self.linear,
                                   quantization=quant.describe() if quant is not None else "")

    def hint(self, session_id: str, expected_arrival: float | None = None, priority: int | None = None) -> Hint:
        """Tell the engine that `session_id` will send a turn soon (e.g. its user started typing;
        `expected_arrival` in seconds if known; higher `priority` is served first). Its host and disk
        chunks start moving up to the device in the background (hidden-state chunks are rebuilt there).
        Returns at once with a `Hint` you may `cancel()` or `wait()` for. Harmless if no request
        follows: prefetched chunks stay evictable, and only free device blocks above the admission
        reserve are used (`hints.py`). With `expected_arrival` the store also ranks the session's KV as if
        active then (`KVStore.expect`, clamped to `max_retain`): kept through a tool pause, never pinned;
        and `warm_ahead` seconds before that time a warm-up brings the rest up, dropped chunks included (`warm`)."""
        h = self.hints.hint(session_id, expected_arrival, priority)     # checks expected_arrival
        if expected_arrival is not None:
            with contextlib.suppress(UnknownSessionError):   # the hint says "unknown session"
                self.warmups.expected(self.store.expect(session_id, expected_arrival))   # clamped by the store
                with self.loop.cv:
                    self.loop.notify()             # an idle loop looks again when a warm-up comes due
        return h

    def warm(self, session_id: str) -> RequestHandle | None:
        """Bring the session's stored KV up to the device now: a warm-up turn (`warmup.py`) that copies
        its lower-tier chunks up and recomputes dropped ones, batched with other work at the lowest
        priority, and adds no tokens; a turn submitted for the session meanwhile ends it. The engine
        does this by itself `warm_ahead` seconds before an expected turn (`hint(expected_arrival=)`,
        `KVStore.expect`). None if there is nothing to bring up or the session is busy or unknown."""
        return self.warmups.warm(session_id)

    # ---- front-ends (frontends.py) --------------------------------------------------------------

    def conversation(self, session_id: str) -> list[dict]:
        """The chat messages kept for a session (a copy)."""
        return self.chats.messages(session_id)

    def chat_submit(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
                    system: str | None = None) -> RequestHandle:
        """Queue the next chat turn over the kept conversation (`Conversations.submit`)."""
        return self.chats.submit(session_id, user_message, sampling, system)

    def chat(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
             system: str | None = None) -> Iterator[str]:
        """Submit the next chat turn now and return an iterator of its text deltas."""
        return self.chat_submit(session_id, user_message, sampling, system).text_deltas()

    def achat(self, session_id: str, user_message: str, sampling: SamplingParams | None = None,
              system: str | None = None) -> AsyncIterator[str]:
        """`chat` for asyncio: an async iterator of text deltas (starts the background loop)."""
        return frontends.achat(self, session_id, user_message, sampling, system)

    async def agenerate(self, session_ids: Sequence[str], prompts: Sequence, sampling: SamplingParams |
                        Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """`generate` for asyncio (starts the background loop)."""
        return await frontends.agenerate(self, session_ids, prompts, sampling)

    def generate(self, session_ids: Sequence[str], prompts: Sequence, sampling: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Submit one turn per (session, prompt) and wait for all. Failed requests are returned with
        finish_reason "error" and `.error` set (they do not raise here)."""
        return frontends.generate(self, session_ids, prompts, sampling, use_tqdm)
