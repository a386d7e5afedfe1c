"""Cluster mode on Ray Serve: N engine replicas (one Serve deployment each, so the router can address
a chosen one), and an ingress deployment running the HTTP app and the session-aware `Router`.

This layer is thin: the routing and migration logic is `router.py` (tested in-process); here a
`RayClient` makes a replica's deployment handle look like a `LocalClient`. A migration passes the
holder's export *response* straight into the target's import call, so the KV travels through Ray's
object store from holder to target without passing through the router.

    ray start --head
    python -m stateful_hf.serve --ray --replicas 2 --model PATH --port 8000
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from . import logs
from .app import ServeConfig, create_app
from .directory import SessionDirectory
from .protocol import APIError
from .replica import freeze_heap
from .router import Router
from .server import EngineOptions, context_length, load_model

log = logging.getLogger(__name__)
APP_NAME = "stateful-hf"


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class EngineReplica:
    """One engine (one device). Each instance is its own deployment: `replica-0`, `replica-1`, ..."""

    def __init__(self, model_path: str | None, options: dict, name: str, dtype: str = "float32",
                 device: str = "cpu", load: dict | None = None):
        logs.configure_from_env()
        model, tokenizer, _ = load_model(model_path, dtype, device, **(load or {}))
        self.replica = EngineOptions(**options).replica(model, tokenizer, name)
        freeze_heap()

    async def stream(self, session_id, prompt, sampling: dict, cache_salt=None, tenant=None,
                     fork=None, continues=None) -> AsyncIterator[dict]:
        async for ev in self.replica.stream(session_id, prompt, sampling, cache_salt=cache_salt, tenant=tenant,
                                            fork=fork, continues=continues):
            yield ev

    async def hint(self, session_id, expected_arrival=None, priority=None) -> dict:
        return self.replica.hint(session_id, expected_arrival, priority)

    async def session_tokens(self, session_id) -> int:
        return self.replica.session_tokens(session_id)

    async def tenant_usage(self, tenant, keys) -> dict:
        return self.replica.tenant_usage(tenant, keys)

    async def session_info(self, session_id) -> dict | None:
        return self.replica.session_info(session_id)

    async def delete_session(self, session_id) -> dict:
        try:
            return {"ok": self.replica.delete_session(session_id)}   # on the loop: atomic with the turn queue
        except APIError as e:                       # crosses to the ingress as plain data
            return {"error": e.to_dict()}

    async def export_session(self, session_id):
        return await asyncio.to_thread(self.replica.export_session, session_id)

    async def import_session(self, exp) -> dict:
        return await asyncio.to_thread(self.replica.import_session, exp)

    async def release_session(self, session_id) -> bool:
        return await asyncio.to_thread(self.replica.release_session, session_id)

    async def snapshot(self) -> list[dict]:
        return self.replica.snapshot()

    async def health(self) -> dict:
        return self.replica.health()

    def __del__(self):
        """Serve stopping this replica: the single-machine server's shutdown (turns cancelled, the disk tier
        flushed within `shutdown_flush_timeout`, the store closed)."""
        replica = getattr(self, "replica", None)       # None: __init__ failed
        if replica is not None:
            replica.shutdown()


class RayClient:
    """A replica deployment's handle with the `LocalClient` interface."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name

    async def stream(self, session_id, prompt, sampling, *, cache_salt=None, tenant=None,
                     fork=None, continues=None) -> AsyncIterator[dict]:
        if dataclasses.is_dataclass(sampling):
            sampling = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)}
        gen = self.handle.options(stream=True).stream.remote(session_id, list(prompt), sampling, cache_salt, tenant,
                                                             fork, continues)
        finished = False
        try:
            async for ev in gen:
                yield ev
            finished = True
        finally:
            if not finished:
                gen.cancel()              # the client went away: the replica cancels the turn

    async def hint(self, session_id, expected_arrival, priority) -> dict:
        return await self.handle.hint.remote(session_id, expected_arrival, priority)

    async def session_tokens(self, session_id) -> int:
        return await self.handle.session_tokens.remote(session_id)

    async def tenant_usage(self, tenant, keys) -> dict:
        return await self.handle.tenant_usage.remote(tenant, list(keys))

    async def session_info(self, session_id) -> dict | None:
        return await self.handle.session_info.remote(session_id)

    async def delete_session(self, session_id) -> dict:
        out = await self.handle.delete_session.remote(session_id)
        if "error" in out:
            raise APIError.from_dict(out["error"])
        return out["ok"]

    async def export(self, session_id):
        return self.handle.export_session.remote(session_id)     # not awaited: passed on by reference

    async def import_(self, payload) -> dict:
        return await self.handle.import_session.remote(payload)

    async def release(self, session_id) -> bool:
        return await self.handle.release_session.remote(session_id)

    async def snapshot(self) -> list[dict]:
        return await self.handle.snapshot.remote()

    async def health(self) -> dict:
        return await self.handle.health.remote()

    async def shutdown(self) -> None:
        pass                               # Serve owns the replicas' lifetime


@serve.deployment(num_replicas=1, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    """The HTTP app and the router (one instance: the router's view of sessions is global)."""

    def __init__(self, model_path: str | None, served_name: str | None, default_max_tokens: int | None, *replicas,
                 access=None, load: dict | None = None, max_model_len: int | None = None, seed: int | None = None,
                 router_db: str | None = None, responses=None, strict_fields: bool = False):
        """`load`: `load_model`'s keyword arguments (revision, trust_remote_code, chat_template).
        `router_db`: the router's session directory file (SQLite; None: in memory only).
        `strict_fields`: an unknown request field is a 400 (--strict-fields)."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from ..models import SOURCES, TINY_MODEL, TINY_MODELS, load_tiny, model_dir, use_chat_template
        load = load or {}
        hub = {k: load[k] for k in ("revision", "trust_remote_code") if k in load}
        if model_path is None or model_path in TINY_MODELS:
            from .server import TINY_NAME
            tiny, tokenizer = load_tiny(model_path or TINY_MODEL)
            max_len = tiny.config.max_position_embeddings
            name = TINY_NAME if (model_path or TINY_MODEL) == TINY_MODEL else f"stateful-hf/{model_path}"
            generation = tiny.generation_config
        else:
            path = str(model_dir(model_path)) if model_path in SOURCES else model_path   # fetched by build_app
            tokenizer, config = AutoTokenizer.from_pretrained(path, **hub), AutoConfig.from_pretrained(path, **hub)
            max_len, name = config.max_position_embeddings, model_path.rstrip("/")
            try:
                generation = GenerationConfig.from_pretrained(path, revision=hub.get("revision"))
            except OSError:                                  # no generation_config.json: the model config's
                generation = GenerationConfig.from_model_config(config)
        if load.get("chat_template") is not None:
            use_chat_template(tokenizer, load["chat_template"])
        directory = SessionDirectory(router_db, len(replicas)) if router_db is not None else None
        self.router = Router([RayClient(h, f"replica-{i}") for i, h in enumerate(replicas)], directory=directory)
        self.config = ServeConfig(served_name or name, tokenizer, context_length(max_len, max_model_len),
                                  default_max_tokens, generation, seed, responses=responses)
        self.config.strict_fields = strict_fields
        self.access = access        # keys file read here at deploy (SIGHUP reload: single machine only)

    def __serve_build_asgi_app__(self):
        return create_app(self.router, self.config, self.access)


def build_app(model_path: str | None, options: EngineOptions, replicas: int, served_name: str | None = None,
              default_max_tokens: int | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
              dtype: str = "float32", device: str = "cpu", access=None, load: dict | None = None,
              max_model_len: int | None = None, seed: int | None = None, router_db: str | None = None,
              responses=None, strict_fields: bool = False):
    """The Serve application: `replicas` engine deployments behind the ingress. `load`: `load_model`'s
    keyword arguments; `max_model_len`, `seed`, `responses`: `build_local`'s; `strict_fields`: --strict-fields."""
    from ..models import SOURCES, fetch
    if model_path in SOURCES:
        fetch(model_path)                  # once, here, before the replicas load it
    opts = options.as_dict()
    actor = {"num_cpus": replica_cpus, "num_gpus": replica_gpus, "runtime_env": {"env_vars": logs.env()}}
    engines = [EngineReplica.options(name=f"replica-{i}", ray_actor_options=actor).bind(
        model_path, opts, f"replica-{i}", dtype, device, load)
        for i in range(replicas)]
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(model_path, served_name, default_max_tokens,
                                                                    *engines, access=access, load=load,
                                                                    max_model_len=max_model_len, seed=seed,
                                                                    router_db=router_db, responses=responses,
                                                                    strict_fields=strict_fields)


def start(model_path: str | None, options: EngineOptions, replicas: int, *, host: str = "127.0.0.1",
          port: int = 8000, **kwargs):
    """Deploy on the connected Ray cluster; HTTP on host:port. Returns the ingress handle."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(model_path, options, replicas, **kwargs), name=APP_NAME, route_prefix="/")


def run_cluster(model_path, options: EngineOptions, replicas: int, *, host: str, port: int, address: str,
                **kwargs) -> None:
    """`python -m stateful_hf.serve --ray`: connect, deploy, serve until interrupted."""
    import ray
    ray.init(address=address)
    start(model_path, options, replicas, host=host, port=port, **kwargs)
    print(f"stateful-hf cluster: {replicas} replicas on Ray Serve, http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(APP_NAME)
