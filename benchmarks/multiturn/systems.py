"""The systems under test. Each serves one turn at a time per caller thread through `run_turn`
(blocking; many user threads call it concurrently) and reports memory in use per tier.

  hf_stateless            `model.generate` on the whole conversation, one request at a time (FCFS)
  hf_continuous_batching  transformers' ContinuousBatchingManager, block sharing (prefix caching) on
  stateful_hf*            stateful_hf.Engine over a SessionStore (variants: tiers, policy, hidden states)

Times are `time.monotonic()` (the engine's clock).
"""

from __future__ import annotations

import dataclasses
import inspect
import queue
import threading
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

import stateful_hf


@dataclass(slots=True)
class TurnResult:
    tokens: list[int]
    first_token_t: float
    end_t: float
    reused: int = 0            # history tokens whose KV was served rather than computed


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()


class _FirstToken(BaseStreamer):
    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):           # the first call carries the prompt, the second the first new token
        self.calls += 1
        if self.calls == 2:
            self.first = time.monotonic()

    def end(self):
        pass


class Stateless:
    """One worker runs `generate` over the full conversation for each request, in arrival order."""

    name = "hf_stateless"

    def __init__(self, model, pad_token_id: int = 0):
        self.model, self.pad = model, pad_token_id
        self.q: queue.Queue = queue.Queue()
        self.peak_context = 0
        self.kv_per_token = kv_bytes_per_token(model)

    def start(self):
        self.worker = threading.Thread(target=self._loop, daemon=True)
        self.worker.start()

    def stop(self):
        self.q.put(None)
        self.worker.join()

    def _loop(self):
        while (job := self.q.get()) is not None:
            ids, n, box, done = job
            try:
                x = torch.tensor([ids])
                streamer = _FirstToken()
                with torch.inference_mode():
                    out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                              min_new_tokens=n, do_sample=False, pad_token_id=self.pad,
                                              eos_token_id=None, streamer=streamer)
                box.append(TurnResult(out[0, len(ids):].tolist(), streamer.first, time.monotonic()))
                self.peak_context = max(self.peak_context, len(ids) + n)
            except BaseException as e:  # handed to the caller
                box.append(e)
            done.set()

    def run_turn(self, conv_id: str, ids: list[int], n: int) -> TurnResult:
        box, done = [], threading.Event()
        self.q.put((ids, n, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def memory(self) -> dict[str, int]:     # the one DynamicCache alive holds at most this
        return {"device": self.peak_context * self.kv_per_token}

    def info(self) -> dict:
        return {"kv_note": "DynamicCache of the largest request (one request at a time)"}


class HFContinuousBatching:
    """transformers' ContinuousBatchingManager with `allow_block_sharing=True`; KV budget = num_blocks."""

    name = "hf_continuous_batching"

    def __init__(self, model, budget_tokens: int, max_batch_tokens: int, max_seqs: int, page_size: int = 32):
        self.gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        self.cb_cfg = ContinuousBatchingConfig(allow_block_sharing=True, num_blocks=budget_tokens // page_size,
                                               page_size=page_size, max_batch_tokens=max_batch_tokens,
                                               max_requests_per_batch=max_seqs)
        self.model = model
        self.pending: dict[str, tuple[list, threading.Event, float | None]] = {}
        self.matched: dict[str, int] = {}
        self.lock = threading.Lock()
        self.counter = 0

    def start(self):
        self.manager = self.model.init_continuous_batching(generation_config=self.gen_cfg,
                                                           continuous_batching_config=self.cb_cfg)
        self.manager.warmup()
        self.cache = self.manager.batch_processor.cache
        search = self.cache.search_prefix_match

        def counted(request_id, prompt_ids):          # how many prompt tokens block sharing served
            n = search(request_id, prompt_ids)
            self.matched[request_id] = self.matched.get(request_id, 0) + n
            return n

        self.cache.search_prefix_match = counted
        self.manager.start()
        self.stopping = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        first: dict[str, float] = {}
        while not self.stopping:
            r = self.manager.get_result(timeout=0.05)
            if r is None:
                continue
            now = time.monotonic()
            if r.request_id not in first and r.generated_tokens:
                first[r.request_id] = now
            if r.error or r.is_finished():
                with self.lock:
                    box, done = self.pending.pop(r.request_id)
                box.append(RuntimeError(f"transformers CB: {r.error}") if r.error else
                           TurnResult(list(r.generated_tokens), first.pop(r.request_id, now), now,
                                      self.matched.get(r.request_id, 0)))
                done.set()

    def stop(self):
        self.stopping = True
        self.reader.join()
        self.manager.stop(block=True, timeout=60)

    def run_turn(self, conv_id: str, ids: list[int], n: int) -> TurnResult:
        box, done = [], threading.Event()
        with self.lock:
            rid = f"{conv_id}#{self.counter}"
            self.counter += 1
            self.pending[rid] = (box, done)
        self.manager.add_request(ids, request_id=rid, max_new_tokens=n, streaming=True, eos_token_id=-1)
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def memory(self) -> dict[str, int]:
        c = self.cache
        return {"device": int((1 - c.compute_free_capacity()) * c.num_sectors * c.bytes_per_sector)}

    def info(self) -> dict:
        return {"kv_capacity_bytes": int(self.cache.num_sectors * self.cache.bytes_per_sector),
                "max_batch_tokens": self.cache.max_batch_tokens}


def store_options() -> set[str]:
    """Keyword options of stateful_hf.SessionStore in this checkout (e.g. hidden_states, if present): its
    declared options (`stateful_hf.options`), or, in an older checkout without them, its signature's."""
    try:
        from stateful_hf.options import SessionStoreOptions
    except ImportError:
        return set(inspect.signature(stateful_hf.SessionStore.__init__).parameters)
    return set(SessionStoreOptions.names())


class StatefulEngine:
    """stateful_hf.Engine over a SessionStore built from `store_kwargs` (same device KV budget)."""

    def __init__(self, name: str, model, budget_tokens: int, max_batch_tokens: int, max_seqs: int, **store_kwargs):
        self.name = name
        self.store = stateful_hf.SessionStore(model, budget_tokens, **store_kwargs)
        self.engine = stateful_hf.Engine(model, store=self.store, max_batch_tokens=max_batch_tokens,
                                         max_num_seqs=max_seqs)

    def start(self):
        self.engine.start()

    def stop(self):
        self.engine.stop()
        self.store.check_integrity()

    def run_turn(self, conv_id: str, ids: list[int], n: int) -> TurnResult:
        out = self.engine.submit(conv_id, ids, stateful_hf.SamplingParams(max_new_tokens=n, ignore_eos=True)).result()
        m = out.metrics
        return TurnResult(list(out.token_ids), m.arrival_time + m.ttft, m.arrival_time + m.latency,
                          m.reused_tokens)       # all kept history: device hits and swap-ins

    def memory(self) -> dict[str, int]:
        st = self.store.stats()
        mem = {"device": st.device_bytes, "host": st.host_bytes, "disk": st.disk_bytes}
        if st.hidden_capacity_tokens:
            mem["hidden"] = st.hidden_bytes
        return mem

    def info(self) -> dict:
        st, es = self.store.stats(), self.engine.stats()
        c = st.counters
        return {"policy": self.store.policy.name, "hit_rate": st.hit_rate,
                "recomputed_tokens": es.recomputed_tokens, "engine_steps": es.steps,
                "mean_batch_tokens": es.mean_batch_tokens, "prompt_rows": es.prompt_tokens,
                "store_counters": dataclasses.asdict(c),
                "capacity_tokens": {"device": st.device_capacity_tokens, "host": st.host_capacity_tokens,
                                    "disk": st.disk_capacity_tokens, "hidden": st.hidden_capacity_tokens}}
