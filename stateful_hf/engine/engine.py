"""`Engine`: many sessions served together; one forward per step mixes prompt chunks, recomputed
history and decode tokens. Submit from any thread; steps run on a background loop (`start()`) or,
without one, in whichever thread waits on a handle."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..cache import DEFAULT_TENANT, SessionBusyError, UnknownSessionError, session_key
from ..integration import check_input_ids
from ..session_store import SessionStore
from .admission import refusal
from .frontends import ChatMixin
from .handle import RequestHandle
from .hints import HintMixin
from .layer_offload import LayerwisePolicy
from .openmp import release_thread_pool
from .request import Request, RequestOutput, RequestStatus
from .runner import ModelRunner, StepRecord
from .sampling import SamplingParams, eos_ids, make_generator
from .scheduler import Scheduler, SchedulerConfig
from .slo import SloPolicy, check_slo
from .text import OutputText


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


class Engine(ChatMixin, HintMixin):
    """Serve many sessions of one model. Args:
    store: a SessionStore of this model (made with `device_capacity`/`chunk_size` if None).
    max_batch_tokens: rows per forward; prefills are chunked to fit. max_num_seqs: running requests.
    reserve_fraction: admit new work only while more than this share of device blocks is available.
    on_busy: a submit for a session that has a turn in flight "wait"s for it or is "refuse"d.
    ttft_slo / tpot_slo: seconds, or None (the default: admission as without them). Per-request
    metrics and `stats()` report violations; with `tpot_slo`, queued prefills are admitted only while
    their predicted prefill time fits in the running decodes' smallest slack (LayerKV, `slo.py`).
    layerwise_kv: LayerKV's layer-wise KV allocation (`cache/layered_chunks.py`): a prefill that does not fit
    with all layers on the device is admitted keeping x >= x_min evenly spaced layers there and the
    rest on the host tier (`host_capacity`, required when the engine makes its store); running
    requests' layers are pushed down to the host when free blocks run short. min_kept_layers: x_min
    (0..layers), or None to derive it from T_offload(L - x) <= T_prefill with profiled costs.
    release_openmp_pool: `start()` frees the calling thread's idle OpenMP workers, so the loop thread's
    pool spins between parallel regions like the main thread's does (`openmp.py`): faster steps on
    cores the engine has to itself, slower ones next to other CPU-bound processes (there pass False,
    or set OMP_WAIT_POLICY=PASSIVE).
    generation_config: where a request's unset sampling fields come from (`sampling_params`):
    "auto" (default) the model's generation config, then SamplingParams' defaults, as vLLM's
    `--generation-config auto`; "library" SamplingParams' defaults only. Greedy either way unless the
    generation config sets do_sample=True.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, store: SessionStore | None = None, *,
                 device_capacity: int | str = "1GiB", chunk_size: int = 32, max_batch_tokens: int = 512,
                 max_num_seqs: int = 128, reserve_fraction: float = 0.1, on_busy: str = "wait",
                 keep_step_records: int = 4096, ttft_slo: float | None = None, tpot_slo: float | None = None,
                 layerwise_kv: bool = False, host_capacity: int | str | None = None,
                 min_kept_layers: int | None = None, release_openmp_pool: bool = True,
                 generation_config: str = "auto"):
        if on_busy not in ("wait", "refuse"):
            raise ValueError(f"on_busy must be 'wait' or 'refuse', got {on_busy!r}")
        if generation_config not in ("auto", "library"):
            raise ValueError(f"generation_config must be 'auto' or 'library', got {generation_config!r}")
        self.generation_config = getattr(model, "generation_config", None) if generation_config == "auto" else None
        self.default_sampling = SamplingParams.from_generation_config(self.generation_config)
        self.ttft_slo, self.tpot_slo = check_slo("ttft_slo", ttft_slo), check_slo("tpot_slo", tpot_slo)
        # None when no SLO is set: the scheduler then admits exactly as before
        self.slo = SloPolicy(self.ttft_slo, self.tpot_slo) if (ttft_slo, tpot_slo) != (None, None) else None
        if min_kept_layers is not None and not layerwise_kv:
            raise ValueError("min_kept_layers needs layerwise_kv=True")
        if store is None:
            store = SessionStore(model, device_capacity, chunk_size=chunk_size, host_capacity=host_capacity,
                                 layerwise_kv=layerwise_kv, attn_backend="torch" if layerwise_kv else "auto")
        elif host_capacity is not None:
            raise ValueError("host_capacity is a store option: pass it to the SessionStore you give")
        self.store = store
        if self.store.model is not model:
            raise ValueError("the store belongs to another model")
        if layerwise_kv and not self.store.layerwise:
            raise ValueError("layerwise_kv=True needs a store made with layerwise_kv=True (or let the engine make it)")
        self.layerwise = _layerwise_policy(model, self.store, min_kept_layers) if layerwise_kv else None
        self.model, self.tokenizer, self.on_busy = model, tokenizer, on_busy
        self.release_openmp_pool = release_openmp_pool
        self.adapter = self.store.adapter
        self.eos = eos_ids(model)
        self.scheduler = Scheduler(self.store, SchedulerConfig(max_batch_tokens, max_num_seqs, reserve_fraction),
                                   self.adapter.max_positions, self.slo, self.layerwise)
        self.runner = ModelRunner(model, self.store)
        self.steps: deque[StepRecord] = deque(maxlen=keep_step_records)
        self._cv = threading.Condition()           # guards inbox, registry; notified after every step
        self._step_lock = threading.Lock()         # one stepping thread at a time
        self._inbox: list[Request] = []
        self._handles: dict[int, RequestHandle] = {}
        self._requests: dict[int, Request] = {}
        self._active = Counter()                   # session id -> unfinished requests
        self._on_finish: dict[int, Callable[[RequestOutput], None]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._totals = Counter()
        self._chats: dict[str, list[dict]] = {}
        self._last_chat: dict[str, RequestHandle] = {}
        self._throwaway: set[str] = set()          # session keys deleted when their last turn ends

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
        rid = next(self._ids)
        handle = RequestHandle(self, rid, session_id)
        r = Request(rid, session_id, [], sampling, None, cache_salt=cache_salt)
        try:
            r.prompt = check_input_ids(self.encode(prompt), self.adapter)
            r.generator = make_generator(sampling, self.store.device_pool.device)
            r.text = OutputText(self.tokenizer, sampling.stop, sampling.skip_special_tokens) \
                if self.tokenizer is not None or sampling.stop else None
        except (ValueError, TypeError) as e:
            return self._reject(handle, r, e)
        never = refusal(self.store, self.layerwise, r)      # before it takes anything (admission.py)
        if never is not None:
            return self._reject(handle, r, never)
        with self._cv:
            busy = session_id in self.store and self.store.session(session_id).busy
            if self.on_busy == "refuse" and (self._active[session_id] or busy):
                return self._reject(handle, r, SessionBusyError(session_id))
            self._handles[rid], self._requests[rid] = handle, r
            self._active[session_id] += 1
            self._inbox.append(r)
            self._cv.notify_all()
        return handle

    def throwaway_session(self, tenant: str | None = None) -> str:
        """A fresh session key of `tenant` (default: the default tenant) that the engine deletes when
        the last turn submitted for it ends (or is refused). `submit(None, ...)` uses one; a caller that
        needs the key before submitting (to watch its moves) takes one here and submits with it."""
        with self._cv:
            while True:
                key = session_key(tenant or DEFAULT_TENANT, f"~{uuid.uuid4().hex}")
                if key not in self._throwaway and key not in self.store:
                    self._throwaway.add(key)
                    return key

    def _forget_throwaway(self, session_id: str) -> None:
        """Delete a throwaway session whose last turn has ended (engine._cv held; steps hold the store
        lock only inside the step lock, so taking it here cannot deadlock)."""
        if session_id in self._throwaway and not self._active[session_id]:
            self._throwaway.discard(session_id)
            with contextlib.suppress(UnknownSessionError):      # refused before its session was opened
                self.store.delete(session_id, keep_shared=True)    # its shared prefix stays findable

    def _reject(self, handle: RequestHandle, r: Request, error: BaseException) -> RequestHandle:
        r.status, r.finish_reason, r.error, r.finished_at = RequestStatus.FAILED, "error", error, time.monotonic()
        with self._cv:
            self._forget_throwaway(r.session_id)
        handle._publish([], "", 0, self._output(r))
        return handle

    def _cancel(self, request_id: int) -> None:
        with self._cv:
            r = self._requests.get(request_id)
            if r is not None:
                r.cancel_requested = True
                self._cv.notify_all()

    # ---- stepping -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def step(self) -> StepRecord | None:
        """Run one engine iteration (admit, schedule, forward, sample, publish). Returns what ran."""
        with self._step_lock:
            with self._cv:
                for r in self._inbox:
                    self.scheduler.add(r)
                self._inbox.clear()
            t0 = time.monotonic()
            items = self.scheduler.schedule()
            record = None
            if items:
                for it in items:
                    it.request.scheduled_at = it.request.scheduled_at or t0
                try:
                    _, tokens = self.runner.execute(items)
                except Exception as e:      # the step was aborted: the store is as before
                    items, tokens = self._isolate(items, e)
                # rows feeding a sampled token (decode) vs prompt rows, told apart before `complete`
                decode_rows = sum(1 for it in items if it.request.output_ids and it.new_ids)
                if items:
                    self.scheduler.complete(items, tokens, self.eos)
                    record = self.runner.record(self._totals["steps"], items, time.monotonic() - t0)
                    self.steps.append(record)
                    self._account(items, record, decode_rows)
                    if self.slo is not None:    # prefill rows = every row but the decode ones
                        self.slo.observe_step(record.num_tokens - decode_rows, decode_rows, record.seconds)
            self._publish(items)
            return record

    def _isolate(self, items, error: Exception) -> tuple[list, list[int]]:
        """A step that raised is rerun one request at a time (each plan is aborted on failure, so the
        store is as before every try): only the requests whose own step raises fail, with their own
        error. Returns the items that ran and their sampled tokens, in order."""
        if len(items) == 1:
            self.scheduler.fail([items[0].request], error)
            return [], []
        ran, tokens = [], []
        for it in items:
            try:
                _, sampled = self.runner.execute([it])
            except Exception as e:
                self.scheduler.fail([it.request], e)
            else:
                ran.append(it)
                tokens += sampled
        return ran, tokens

    def _account(self, items, record: StepRecord, decode_rows: int) -> None:
        t = self._totals
        t["steps"] += 1
        t["prompt"] += sum(len(it.new_ids) for it in items) - decode_rows
        t["recomputed"] += sum(len(it.recompute) for it in items)
        t["generated"] += sum(it.needs_logits for it in items)
        t["rows"] += record.num_tokens
        t["busy_us"] += int(record.seconds * 1e6)
        t["occupancy_ppm"] += int(1e6 * record.used_blocks / max(record.total_blocks, 1))

    def _publish(self, items) -> None:
        finished = self.scheduler.drain_finished()
        with self._cv:
            for it in items:
                r = it.request
                if not r.status.done and it.needs_logits:
                    text = r.text.text if r.text else ""
                    self._handles[r.request_id]._publish(r.output_ids, text, r.text.stable if r.text else 0)
            for r in finished:
                if r.text is not None:
                    r.text.finish()
                out = self._output(r)
                self._account_slo(r, out)
                on_finish = self._on_finish.pop(r.request_id, None)
                if on_finish is not None:     # before the handle reads as done (chat: the reply is kept first)
                    on_finish(out)
                self._requests.pop(r.request_id, None)
                self._active[r.session_id] -= 1
                if not self._active[r.session_id]:
                    del self._active[r.session_id]
                self._forget_throwaway(r.session_id)       # before the handle reads as done
                self._handles.pop(r.request_id)._publish(r.output_ids, out.text or "", len(out.text or ""), out)
                self._totals["finished"] += 1
            self._cv.notify_all()

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(r.request_id, r.session_id, tuple(r.output_ids), r.text.text if r.text else None,
                             r.finish_reason, r.metrics(self.ttft_slo, self.tpot_slo), r.error,
                             tuple(r.logprobs) if r.sampling.logprobs is not None else None)

    def _account_slo(self, r: Request, out: RequestOutput) -> None:
        if self.slo is None:
            return
        self.slo.observe_finished(r)
        t, m = self._totals, out.metrics
        for name, violated in (("ttft", m.ttft_slo_violated), ("tpot", m.tpot_slo_violated)):
            if violated is not None:
                t[f"{name}_measured"] += 1
                t[f"{name}_violations"] += violated

    def _wait_until(self, pred: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait for `pred`; drive steps in this thread when no background loop runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pred():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if self.running or not self.has_work():
                with self._cv:
                    self._cv.wait_for(pred, timeout=0.05 if left is None else min(left, 0.05))
            else:
                self.step()

    # ---- background loop ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Engine:
        """Start the background loop (idempotent). With `release_openmp_pool`, the calling thread's
        idle OpenMP workers are released first: alive, they make the loop's pool run throttled."""
        with self._cv:
            if not self.running:
                if self.release_openmp_pool:
                    release_thread_pool()
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="stateful-hf-engine", daemon=True)
                self._thread.start()
        return self

    def stop(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop the loop after the requests in flight finish (or are cancelled, with `cancel`)."""
        if cancel:
            with self._cv:
                for r in list(self._requests.values()):
                    r.cancel_requested = True
        self._wait_until(lambda: not self.has_work(), timeout)     # inline: drives the steps itself
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self.has_work())
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:          # a bug, not a request's fault: fail what is in flight, go on
                with self._step_lock:
                    self.scheduler.fail(self.scheduler.running + self.scheduler.waiting, e)
                    self._publish(())

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(cancel=exc[0] is not None)

    # ---- convenience ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        t = self._totals
        busy = t["busy_us"] / 1e6
        return EngineStats(steps=t["steps"], finished_requests=t["finished"], prompt_tokens=t["prompt"],
                           recomputed_tokens=t["recomputed"], generated_tokens=t["generated"], busy_seconds=busy,
                           tokens_per_second=t["generated"] / busy if busy else 0.0,
                           mean_batch_tokens=t["rows"] / max(t["steps"], 1),
                           mean_occupancy=t["occupancy_ppm"] / 1e6 / max(t["steps"], 1),
                           running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           ttft_measured=t["ttft_measured"], ttft_slo_violations=t["ttft_violations"],
                           ttft_slo_violation_rate=t["ttft_violations"] / max(t["ttft_measured"], 1),
                           tpot_measured=t["tpot_measured"], tpot_slo_violations=t["tpot_violations"],
                           tpot_slo_violation_rate=t["tpot_violations"] / max(t["tpot_measured"], 1),
                           slo_deferrals=self.slo.deferred if self.slo is not None else 0,
                           layered_admissions=self.layerwise.layered_admissions if self.layerwise else 0,
                           pushed_blocks=self.layerwise.pushed_blocks if self.layerwise else 0)

    def generate(self, session_ids: Sequence[str], prompts: Sequence, sampling: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Submit one turn per (session, prompt) and wait for all. Failed requests are returned with
        finish_reason "error" and `.error` set (they do not raise here)."""
        if len(session_ids) != len(prompts):
            raise ValueError(f"{len(session_ids)} session ids for {len(prompts)} prompts")
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        handles = [self.submit(s, p, sp) for s, p, sp in zip(session_ids, prompts, params, strict=True)]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(handles), desc="generate", unit="req")
        done = 0
        while done < len(handles):
            self._wait_until(lambda seen=done: sum(h.done for h in handles) > seen)
            now = sum(h.done for h in handles)
            if bar is not None:
                bar.update(now - done)
            done = now
        if bar is not None:
            bar.close()
        return [h.output() for h in handles]


def _layerwise_policy(model, store, min_kept_layers: int | None) -> LayerwisePolicy:
    """LayerKV's policy with this machine's costs: the device -> host bandwidth of one layer's blocks
    and the prefill time model Σ Cost(context) of the store's cost profile (measured if it has none)."""
    from ..profile import measure_cost_profile, measure_offload_bandwidth

    spec = store.spec
    profile = getattr(store.policy, "profile", None) or measure_cost_profile(model, spec)
    layer_bytes = spec.bytes_per_token // spec.num_layers        # K + V of one layer, one token
    return LayerwisePolicy(spec.num_layers, layer_bytes, measure_offload_bandwidth(store.device_pool), profile,
                           spec.block_size, min_kept_layers)
