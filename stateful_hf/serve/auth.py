"""Who is calling: API keys (each names a tenant), checked before a request reaches the app.

`Guard` is an ASGI middleware in front of the whole app. In order, for every HTTP request:
1. `/health` is open; `/metrics` is open unless a metrics key is set; every other path (all of
   `/v1/*`) needs `Authorization: Bearer <key>` with a key of the `KeyRing`, else 401 in OpenAI's
   error shape. The key's tenant goes into the request's state (`request_tenant`). Without a key
   ring (no key configured) every request is the default tenant's.
2. A body longer than `max_body_bytes` gets 413 (by Content-Length before reading, or while reading).
   (FastAPI's own `max_body_size` is newer than the fastapi>=0.110 we support, and answers in its
   `{"detail"}` shape, not OpenAI's.)

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every key of the ring (no
early exit), so the time taken does not depend on how much of a key was right. `KeyRing.reload()`
re-reads the keys file (the server calls it on SIGHUP): a request authenticated before keeps
running; a removed key is refused from the next request on; sessions are untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass, field

from ..cache.sessions.tenant import DEFAULT_TENANT, check_tenant
from .limits import Limits
from .protocol import APIError

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/ping")      # probes (load balancers, SageMaker) send no key
METRICS_PATH = "/metrics"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """{key: tenant} from a file of `key tenant` lines ('#' starts a comment; blank lines skipped)."""
    keys: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2:
                raise ValueError(f"{path}:{n}: expected `key tenant`, got {len(words)} words")
            key, tenant = words
            try:
                check_tenant(tenant)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            if key in keys:
                raise ValueError(f"{path}:{n}: this key is listed twice")
            keys[key] = tenant
    return keys


class KeyRing:
    """API keys -> tenants: `api_key` (tenant `default`) and the lines of `keys_file`.
    Invariant: `_entries` is replaced whole (never mutated), so a lookup sees one generation."""

    def __init__(self, api_key: str | None = None, keys_file: str | os.PathLike | None = None):
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key is empty")
        self.api_key, self.keys_file = api_key, keys_file
        self._entries: tuple[tuple[bytes, str], ...] = ()
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> int:
        keys = {} if self.keys_file is None else parse_keys_file(self.keys_file)
        if self.api_key is not None:
            if keys.get(self.api_key, DEFAULT_TENANT) != DEFAULT_TENANT:
                raise ValueError("--api-key is also in the keys file under another tenant")
            keys[self.api_key] = DEFAULT_TENANT
        short = sorted({t for k, t in keys.items() if len(k) < 16})
        if short:
            log.warning("API keys shorter than 16 characters (tenants %s): use long random keys", short)
        with self._lock:
            self._entries = tuple((_digest(k), t) for k, t in keys.items())
        return len(keys)

    def reload(self) -> bool:
        """Re-read the keys file. On an error the keys in force stay (and the error is logged)."""
        try:
            n = self._load()
        except (OSError, ValueError) as e:
            log.error("API keys NOT reloaded (the previous keys stay in force): %s", e)
            return False
        log.info("API keys reloaded: %d keys", n)
        return True

    @property
    def tenants(self) -> set[str]:
        return {t for _, t in self._entries}

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self):                # crosses to a Ray actor as plain data (no lock)
        return {"api_key": self.api_key, "keys_file": self.keys_file}

    def __setstate__(self, state):
        self.__init__(state["api_key"], state["keys_file"])

    def tenant(self, key: str | None) -> str | None:
        """The tenant of `key`, or None if it is no key of the ring."""
        if not key:
            return None
        d, found = _digest(key), None
        for digest, tenant in self._entries:         # all of them, whatever matches
            if hmac.compare_digest(d, digest):
                found = tenant
        return found


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """Which web pages may call the API from a browser: Starlette's CORSMiddleware, in front of `Guard`
    (a preflight carries no key). No `origins`: no CORS headers (a browser's OPTIONS gets 405)."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("origins", "methods", "headers"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"CorsPolicy.{name} must be a tuple of non-empty strings, got {v!r}")


@dataclass(frozen=True)
class Access:
    """Who may call and how much: `keys` None serves everyone as the default tenant (loopback only,
    enforced by `python -m stateful_hf.serve`); `metrics_key` guards /metrics; `limits` (limits.py);
    `cors`: the browser origins allowed."""

    keys: KeyRing | None = None
    metrics_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    cors: CorsPolicy = field(default_factory=CorsPolicy)


def request_tenant(request) -> str:
    """The tenant `Guard` found for this request (the default tenant when no keys are configured)."""
    return request.scope.get("state", {}).get("tenant", DEFAULT_TENANT)


def _bearer(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _refuse(send, e: APIError, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(e.body()).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def _unauthorized(token: str | None) -> APIError:
    if token is None:
        return APIError(401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                        "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", code="missing_api_key")
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


class Guard:
    """The ASGI middleware (see the module docstring). `on_error(e)` is told of every refusal."""

    def __init__(self, app, access: Access, on_error=None):
        self.app, self.access, self.on_error = app, access, on_error

    async def _refuse(self, send, e: APIError, headers: dict[str, str] | None = None) -> None:
        if self.on_error is not None:
            self.on_error(e)
        await _refuse(send, e, headers)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, access = scope["path"], self.access
        if path == METRICS_PATH:
            if access.metrics_key is not None:
                token = _bearer(scope)
                if token is None or not hmac.compare_digest(_digest(token), _digest(access.metrics_key)):
                    return await self._refuse(send, _unauthorized(token), {"WWW-Authenticate": "Bearer"})
        elif path not in OPEN_PATHS:
            tenant = DEFAULT_TENANT
            if access.keys is not None:
                token = _bearer(scope)
                tenant = access.keys.tenant(token)
                if tenant is None:
                    return await self._refuse(send, _unauthorized(token), {"WWW-Authenticate": "Bearer"})
            scope.setdefault("state", {})["tenant"] = tenant
        limit = access.limits.max_body_bytes
        too_big = APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                           "(--max-body-bytes)", code="request_too_large")
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._refuse(send, too_big)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        parts, total = [], 0
        while True:                                # read the body here, up to the limit
            msg = await receive()
            if msg["type"] != "http.request":
                return                             # the client went away
            parts.append(msg.get("body", b""))
            total += len(parts[-1])
            if total > limit:
                return await self._refuse(send, too_big)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(parts), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
