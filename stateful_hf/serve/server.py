"""Building the single-machine server, running it until SIGTERM or Ctrl-C (`serve`: the in-flight turns
cancelled, the replicas' disk tiers flushed, then exit), and running uvicorn in a thread (tests, notebooks)."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import uvicorn

from ..cache import FairSharePolicy
from ..engine import Engine
from ..integration.session_store import SessionStore
from ..options import EngineConfig, EngineKwargs, SessionStoreOptions, Unpack, split_engine_options
from .app import ServeConfig, create_app
from .auth import Access
from .flags import SERVER_DEFAULTS
from .local_client import LocalClient
from .replica import Replica, freeze_heap
from .router import Router

log = logging.getLogger(__name__)
TINY_NAME = "stateful-hf/tiny-llama-random"
# The shutdown's budget (docs/durability.md, "Shutdown"): the exit signal cancels the turns in flight, their
# streams end and the connections close within DRAIN_TIMEOUT s, then each replica stops its engine and flushes
# its disk tier within --shutdown-flush-timeout s (default SHUTDOWN_FLUSH_TIMEOUT): cancel + flush + exit <= 10 s.
DRAIN_TIMEOUT = 3.0
SHUTDOWN_FLUSH_TIMEOUT = 4.0


class EngineOptions:
    """How each replica's store and engine are made: `Engine`'s keyword arguments (its options and its
    store's, declared in `stateful_hf/options/`; `SERVER_DEFAULTS` under them), checked here (TypeError
    for an unknown one, ValueError for a bad value), and the server's own: `session_wait_timeout`
    (seconds a turn waits for its session's previous turn; then 409), `fair_share` (tenants above their
    share of a tier are evicted first), `tenant_shares` (tenant -> weight, default 1) and
    `shutdown_flush_timeout` (seconds a replica's shutdown gives the disk tier's flush; 0: none). Plain data:
    `as_dict()` crosses to Ray replicas and `EngineOptions(**d)` makes it again."""

    __slots__ = ("engine", "session_wait_timeout", "fair_share", "tenant_shares", "shutdown_flush_timeout")

    def __init__(self, *, session_wait_timeout: float = 30.0, fair_share: bool = True,
                 tenant_shares: dict | None = None, shutdown_flush_timeout: float = SHUTDOWN_FLUSH_TIMEOUT,
                 **engine: Unpack[EngineKwargs]):
        merged = {**SERVER_DEFAULTS, **engine}
        engine_options, store_options = split_engine_options(merged)
        EngineConfig.build(**engine_options)
        # checked as each replica's store will be; `build` may give each replica its own disk_dir
        SessionStoreOptions.build(**{"disk_dir": "replica", **store_options})
        if not (isinstance(session_wait_timeout, (int, float)) and session_wait_timeout > 0):
            raise ValueError(f"session_wait_timeout must be > 0 seconds, got {session_wait_timeout!r}")
        if isinstance(shutdown_flush_timeout, bool) or not isinstance(shutdown_flush_timeout, (int, float)) or \
                not 0 <= shutdown_flush_timeout < math.inf:
            raise ValueError(f"shutdown_flush_timeout must be a number of seconds >= 0, got {shutdown_flush_timeout!r}")
        self.engine, self.session_wait_timeout = merged, float(session_wait_timeout)
        self.fair_share, self.tenant_shares = bool(fair_share), dict(tenant_shares or {})
        self.shutdown_flush_timeout = float(shutdown_flush_timeout)

    def as_dict(self) -> dict:
        return {**self.engine, "session_wait_timeout": self.session_wait_timeout, "fair_share": self.fair_share,
                "tenant_shares": dict(self.tenant_shares), "shutdown_flush_timeout": self.shutdown_flush_timeout}

    def __repr__(self) -> str:
        return f"EngineOptions({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    def build(self, model, tokenizer, disk_dir: str | None = None) -> Engine:
        engine_options, store_options = split_engine_options(self.engine)
        if disk_dir is not None:
            store_options["disk_dir"] = disk_dir
        store = SessionStore(model, store_options.pop("device_capacity"), **store_options)
        if self.fair_share:
            store.policy = FairSharePolicy(store.policy, self.tenant_shares)
        # the replica's SessionQueue already runs a session's turns one at a time; "wait" covers the
        # moment between a turn's output and the end of its lease
        engine_options["on_busy"] = "wait"
        if store_options.get("layerwise_kv"):
            engine_options["layerwise_kv"] = True
        return Engine(model, tokenizer, store, **engine_options)

    def replica(self, model, tokenizer, name: str = "0", disk_dir: str | None = None) -> Replica:
        return Replica(self.build(model, tokenizer, disk_dir), name, self.session_wait_timeout,
                       self.shutdown_flush_timeout)


def load_model(path: str | None, dtype: str = "float32", device: str = "cpu", *, revision: str | None = None,
               trust_remote_code: bool = False, chat_template: str | None = None, quantization: str | None = None):
    """(model, tokenizer, name). `path`: a named model of stateful_hf.models (fetched once), a checkpoint
    directory or hub id; None, "tiny-random" or "tiny-qwen3": an offline tiny fixture, whose weights are
    random. The keyword arguments are `stateful_hf.models.load`'s."""
    from ..models import TINY_MODEL, TINY_MODELS, load
    if path is None or path in TINY_MODELS:
        log.warning("serving an offline tiny fixture; its weights are RANDOM, its replies are gibberish "
                    "(useful for trying the API, not for chatting)")
        path = path or TINY_MODEL
        name = TINY_NAME if path == TINY_MODEL else f"stateful-hf/{path}"
    else:
        name = path.rstrip("/")
    model, tokenizer = load(path, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code,
                            chat_template=chat_template, quantization=quantization)
    return model, tokenizer, name


def context_length(model_len: int, max_model_len: int | None) -> int:
    """The context the server enforces: `--max-model-len`, at most the model's own (else ValueError)."""
    if max_model_len is None:
        return model_len
    if max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} is more than the model's context of {model_len} tokens "
                         "(max_position_embeddings)")
    return max_model_len


def build_local(model, tokenizer, name: str, options: EngineOptions | None = None,
                default_max_tokens: int | None = None, access: Access | None = None, *,
                max_model_len: int | None = None, seed: int | None = None, responses=None):
    """The single-machine server: one replica behind the router. Returns (app, router).
    default_max_tokens: cap on a chat's max_tokens when the request has none (None: the room left).
    `access`: API keys, limits and CORS (auth.py); None: no keys (the default tenant), default limits.
    max_model_len: the context enforced (None: the model's). seed, responses: `ServeConfig`'s."""
    replica = (options or EngineOptions()).replica(model, tokenizer)
    try:
        context = context_length(replica.engine.adapter.max_positions, max_model_len)
    except ValueError:
        replica.shutdown()
        raise
    router = Router([LocalClient(replica)])
    config = ServeConfig(name, tokenizer, context, default_max_tokens, replica.engine.generation_config, seed,
                         replica.engine.config.grammar_compile_timeout, responses)
    return create_app(router, config, access), router


class ServerThread:
    """uvicorn serving `app` on host:port (0: a free port) in a daemon thread. `url` once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="stateful-hf-uvicorn", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 30) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("the server did not stop")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()



class SignalledServer(uvicorn.Server):
    """uvicorn's server whose exit signal first cancels the `replicas`' turns in flight, and whose shutdown
    ends with each replica's (`serve`)."""

    def __init__(self, config: uvicorn.Config, replicas: list[Replica]):
        super().__init__(config)
        self.replicas, self.signalled = replicas, None

    def handle_exit(self, sig, frame) -> None:
        """The signal handler (the main thread, between two bytecodes, which may hold the engine's lock: the
        cancel runs in a thread of its own)."""
        if self.signalled is None:
            self.signalled = time.monotonic()
            threading.Thread(target=lambda: [r.cancel_turns() for r in self.replicas], name="stateful-hf-cancel",
                             daemon=True).start()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        t0 = self.signalled or time.monotonic()
        await super().shutdown(sockets)             # the connections close (their turns were cancelled)
        t1 = time.monotonic()
        reports = await asyncio.gather(*(asyncio.to_thread(r.shutdown) for r in self.replicas))
        t2 = time.monotonic()
        log.info("shutdown: %d turns cancelled and the connections closed in %.3f s from the signal, replicas "
                 "stopped and flushed in %.3f s (%.3f s in all; the process exits now)",
                 sum(r.cancelled for r in reports), t1 - t0, t2 - t1, t2 - t0,
                 extra={"event": "shutdown", "drain_s": round(t1 - t0, 6), "replicas_s": round(t2 - t1, 6),
                        "total_s": round(t2 - t0, 6)})


def serve(app, router: Router, host: str, port: int, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT (`python -m stateful_hf.serve`). The signal cancels every
    turn in flight at once (so the graceful shutdown does not wait for long streams: each ends with finish_reason
    "cancelled"); the connections close (at most `DRAIN_TIMEOUT` s); then each local replica shuts down
    (`Replica.shutdown`: the engine stopped, the disk tier flushed within its `shutdown_flush_timeout`, the
    store closed) and one line logs the phases' times; then the process exits as the signal asks (uvicorn
    raises it again)."""
    replicas = [c.replica for c in router.clients if isinstance(c, LocalClient)]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None,
                            timeout_graceful_shutdown=DRAIN_TIMEOUT)
    frozen = freeze_heap()
    logging.getLogger("stateful_hf.serve").debug("froze %d objects of the startup heap", frozen)
    SignalledServer(config, replicas).run()
