"""Building the single-machine server, and running uvicorn in a thread (tests, notebooks)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ..engine import Engine
from ..store import SessionStore
from .app import ServeConfig, create_app
from .replica import Replica
from .router import LocalClient, Router

log = logging.getLogger(__name__)
TINY_NAME = "stateful-hf/tiny-llama-random"


@dataclass
class EngineOptions:
    """How each replica's store and engine are made (also crosses to Ray replicas as plain data)."""

    device_capacity: int | str = "256MiB"
    host_capacity: int | str | None = None
    disk_dir: str | None = None
    disk_capacity: int | str | None = None
    chunk_size: int = 32
    max_batch_tokens: int = 512
    max_num_seqs: int = 256
    store_kwargs: dict = field(default_factory=dict)

    def build(self, model, tokenizer, disk_dir: str | None = None) -> Engine:
        store = SessionStore(model, self.device_capacity, chunk_size=self.chunk_size,
                             host_capacity=self.host_capacity, disk_dir=disk_dir or self.disk_dir,
                             disk_capacity=self.disk_capacity, **self.store_kwargs)
        # on_busy="refuse": a turn for a session with one in flight gets HTTP 409 (see the README)
        return Engine(model, tokenizer, store, max_batch_tokens=self.max_batch_tokens,
                      max_num_seqs=self.max_num_seqs, on_busy="refuse")


def load_model(path: str | None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, name). `path`: a named model of stateful_hf.models (fetched once), a checkpoint
    directory or hub id; None or "tiny-random": the offline tiny fixture, whose weights are random."""
    from ..models import TINY_MODEL, load
    if path is None or path == TINY_MODEL:
        log.warning("serving the offline tiny Llama fixture; its weights are RANDOM, its replies are gibberish "
                    "(useful for trying the API, not for chatting)")
        path, name = TINY_MODEL, TINY_NAME
    else:
        name = path.rstrip("/")
    model, tokenizer = load(path, dtype=dtype, device=device)
    return model, tokenizer, name


def build_local(model, tokenizer, name: str, options: EngineOptions | None = None,
                default_max_tokens: int = 256):
    """The single-machine server: one replica behind the router. Returns (app, router)."""
    engine = (options or EngineOptions()).build(model, tokenizer)
    router = Router([LocalClient(Replica(engine))])
    config = ServeConfig(name, tokenizer, engine.adapter.max_positions, default_max_tokens)
    return create_app(router, config), router


class ServerThread:
    """uvicorn serving `app` on host:port (0: a free port) in a daemon thread. `url` once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
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
