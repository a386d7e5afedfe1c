"""Session-aware router over engine replicas, with hint-driven KV migration (Symphony).

- A request goes where it is cheapest: to the replica holding its session's KV, unless that
  replica has more than `overload_slack` more requests in flight than the least-loaded one (soft
  affinity); then to the least-loaded replica, which first pulls the session's KV from the holder.
- A hint picks the target per request, by load (in flight + hinted arrivals, then requests served
  over the run: balanced even under skewed sessions), preferring the holder on a tie, and starts
  moving the session's KV there off the critical path: the holder exports it (history + stored
  chunks of every tier), the target imports it onto its device, the holder forgets it. The hinted
  request then goes to the target; if it arrives mid-migration it waits for the migration.
- A request with no KV of its own anywhere (no session id, or a session's first turn) goes to the
  replica that last served the longest prefix of its prompt in its scope (`prefix_affinity.py`), where
  the replica's prefix sharing reuses it, under the same soft rule (`overload_slack`); else to the
  least-loaded replica.
- Turns of one session never run on two replicas at once: while one is in flight the next goes to
  the same replica (where the engine's busy rule applies), and a migration waits for it to end.

Replicas are reached through clients with one async interface (`LocalClient` in-process,
`local_client.py`; `cluster.RayClient` for Ray Serve handles). Where each session is held is the
router's `location`, a `SessionDirectory` (`directory.py`): kept in SQLite when given a path, so that
a restarted router routes every returning turn to its holder without asking the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator

from ..cache.sessions.tenant import DEFAULT_TENANT, split_key
from .directory import SessionDirectory
from .exposition import merge, render
from .prefix_affinity import PrefixAffinity
from .protocol import APIError
from .router_metrics import RouterMetrics

log = logging.getLogger(__name__)


class Router:
    def __init__(self, clients: list, overload_slack: int = 2, hint_ttl: float = 60.0,
                 affinity: PrefixAffinity | None = None, directory: SessionDirectory | None = None):
        if not clients:
            raise ValueError("a router needs at least one replica")
        self.clients, self.overload_slack, self.hint_ttl = list(clients), overload_slack, hint_ttl
        n = len(self.clients)
        # session -> replica holding its KV (persistent with a path: `directory.py`)
        self.location: SessionDirectory = directory if directory is not None else SessionDirectory()
        self.affinity = affinity or PrefixAffinity()   # prompt prefix -> replica that served it
        self.planned: dict[str, int] = {}         # hinted session -> replica its next request goes to
        self._plan_expiry: dict[str, float] = {}  # ... until then (a hint whose request never came)
        self.migrations: dict[str, asyncio.Task] = {}
        self.load, self.expected, self.assigned = [0] * n, [0] * n, [0] * n
        self._running: dict[str, tuple[int, int]] = {}   # session -> (replica, requests in flight)
        self._idle: dict[str, asyncio.Event] = {}
        self.stats = Counter()
        self.migration_seconds = 0.0
        self.metrics = RouterMetrics(self, hint_ttl)
        self._forks: dict[str, int] = {}          # fork group (choices.py) -> the replica of its first turn in flight

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.clients]

    def _expire_plans(self) -> None:
        now = time.monotonic()
        for sid in [s for s, t in self._plan_expiry.items() if t < now]:
            self._unplan(sid)

    def _unplan(self, sid: str) -> int:
        i = self.planned.pop(sid)
        del self._plan_expiry[sid]
        self.expected[i] -= 1
        return i

    def _least_loaded(self, prefer: int | None = None) -> int:
        key = lambda i: (self.load[i] + self.expected[i], self.assigned[i], i != prefer, i)
        return min(range(len(self.clients)), key=key)

    def _route(self, sid: str | None, keys: list[int]) -> tuple[int, bool]:
        """(replica, whether the session's KV must be pulled there first). `keys`: the prompt's
        prefix keys (`PrefixAffinity.keys`), used when the session's KV is nowhere."""
        self._expire_plans()
        if sid is None or (sid not in self._running and sid not in self.planned and sid not in self.location):
            return self._by_prefix(keys), False
        if sid in self._running:                  # a turn of it is in flight: same replica
            return self._running[sid][0], False
        if sid in self.planned:
            i = self._unplan(sid)
            return i, self.location.get(sid, i) != i
        holder = self.location[sid]
        least = self._least_loaded(prefer=holder)
        if self.load[holder] - self.load[least] > self.overload_slack:
            self.stats["affinity_overridden"] += 1
            return least, True
        return holder, False

    def _by_prefix(self, keys: list[int]) -> int:
        """The replica holding the longest prefix of the prompt, unless it has more than
        `overload_slack` more requests in flight than the least-loaded one; else the least-loaded."""
        at, _ = self.affinity.lookup(keys)
        least = self._least_loaded(prefer=at)
        if at is None or at == least:
            return least
        if self.load[at] - self.load[least] > self.overload_slack:
            self.stats["prefix_affinity_overridden"] += 1
            return least
        self.stats["prefix_routed"] += 1
        return at

    # ---- requests -------------------------------------------------------------------------------

    async def _locate(self, sid: str) -> None:
        """A session this router has not seen may still be stored on a replica (a restarted router,
        replicas reopening their disk tiers): ask them once; the one holding most tokens is the holder."""
        if sid in self.location or sid in self._running or len(self.clients) == 1:
            return
        held = await asyncio.gather(*(c.session_tokens(sid) for c in self.clients))
        if max(held) > 0 and sid not in self.location:
            self.location[sid] = max(range(len(held)), key=lambda i: held[i])

    async def stream(self, session_id: str | None, prompt: list[int], sampling, *, cache_salt: str | None = None,
                     tenant: str | None = None, fork: str | None = None,
                     continues: str | None = None) -> AsyncGenerator[dict, None]:
        """One turn on the replica `_route` picks. `session_id` None: a throwaway session of `tenant`
        there; `cache_salt` scopes its prefix sharing (both passed to the replica). `fork`: the turn's
        fork group (`Replica.stream`); a new session's turn goes where the group's first turn runs.
        `continues`: the held choice the session takes first (`Replica.stream`; made on the session's
        replica, so it is there unless the session has moved since: then the turn recomputes)."""
        sid = session_id
        if sid is not None:
            await self._locate(sid)
        if sid is not None and sid in self.migrations:
            await asyncio.shield(self.migrations[sid])             # mid-migration: wait, don't recompute
        self.metrics.arrived(sid)
        keys = self.affinity.keys(prompt, (tenant or DEFAULT_TENANT) if sid is None else split_key(sid)[0], cache_salt)
        i, pull = self._route(sid, keys)
        owner = fork is not None and fork not in self._forks
        if fork is not None:
            first = self._forks.setdefault(fork, i)
            if not pull and (sid is None or sid not in self.location):
                i = first
        self.affinity.record(keys, i)
        if pull:
            await asyncio.shield(self._start_migration(sid, i))    # no hint came: pull at arrival
        self.load[i] += 1
        self.assigned[i] += 1
        self.stats[f"requests_{i}"] += 1
        if sid is not None:
            r, n = self._running.get(sid, (i, 0))
            self._running[sid] = (r, n + 1)
            self._idle.setdefault(sid, asyncio.Event()).clear()
        try:
            async with contextlib.aclosing(self.clients[i].stream(sid, prompt, sampling, cache_salt=cache_salt,
                                                                  tenant=tenant, fork=fork,
                                                                  continues=continues)) as events:
                async for ev in events:
                    yield ev
        finally:
            if owner:
                self._forks.pop(fork, None)
            self.load[i] -= 1
            if sid is not None:
                r, n = self._running[sid]
                if n > 1:
                    self._running[sid] = (r, n - 1)
                else:
                    del self._running[sid]
                    self._idle.pop(sid).set()
                self.location[sid] = i

    # ---- sessions -------------------------------------------------------------------------------

    async def _owner(self, sid: str) -> int:
        """The replica holding the session (after any migration of it); 404 if none does."""
        await self._locate(sid)
        if sid in self.migrations:
            await asyncio.shield(self.migrations[sid])
        if sid in self._running:
            return self._running[sid][0]
        if sid in self.location:
            return self.location[sid]
        if len(self.clients) == 1:
            return 0
        raise APIError(404, f"no session {sid!r}", param="session_id", code="session_not_found",
                       type="not_found_error")

    async def session_info(self, sid: str) -> dict:
        info = await self.clients[await self._owner(sid)].session_info(sid)
        if info is None:
            raise APIError(404, f"no session {sid!r}", param="session_id", code="session_not_found",
                           type="not_found_error")
        return info

    async def delete_session(self, sid: str) -> dict:
        """Delete on the owning replica (409 while a turn of it runs or waits there)."""
        i = await self._owner(sid)
        if sid in self._running:
            raise APIError(409, f"session {sid!r} has a turn in flight or queued; delete it when the turn has "
                           "finished", param="session_id", code="session_busy", retry_after=1)
        out = await self.clients[i].delete_session(sid)
        if self.location.get(sid) == i:
            del self.location[sid]
        if sid in self.planned:
            self._unplan(sid)
        return out

    # ---- hints and migration --------------------------------------------------------------------

    async def hint(self, session_id: str, expected_arrival: float | None = None, priority: int | None = None) -> dict:
        await self._locate(session_id)
        self._expire_plans()
        if session_id in self._running or session_id in self.planned:
            i = self._running[session_id][0] if session_id in self._running else self.planned[session_id]
            migrating = session_id in self.migrations
        else:
            holder = self.location.get(session_id)
            i = self._least_loaded(prefer=holder)
            self.planned[session_id] = i
            self._plan_expiry[session_id] = time.monotonic() + (expected_arrival or 0.0) + self.hint_ttl
            self.expected[i] += 1
            migrating = holder is not None and holder != i
            if migrating:
                self._start_migration(session_id, i)
        self.stats["hints"] += 1
        self.metrics.hinted(session_id)
        if not migrating:   # KV already there (or nowhere): the replica prefetches its lower tiers
            await self.clients[i].hint(session_id, expected_arrival, priority)
        return {"session_id": session_id, "replica": self.clients[i].name, "migrating": migrating}

    async def retain(self, session_id: str, seconds: float) -> None:
        """The session's next turn is expected within `seconds` (`X-Session-Retain`): its holder ranks its KV
        to stay (a hint's expected_arrival there, clamped to `--max-retain`); nothing is planned or moved."""
        holder = self._running[session_id][0] if session_id in self._running else self.location.get(session_id)
        if holder is not None:       # a stream's turn may still be running there
            await self.clients[holder].hint(session_id, seconds, None)

    def _start_migration(self, sid: str, dst: int) -> asyncio.Task:
        """Start moving the session's KV to `dst`; registered at once, so a request arriving from now
        on waits for it. One migration per session at a time (a new one runs after the previous)."""
        task = asyncio.create_task(self._migrate(sid, dst, self.migrations.get(sid)))
        self.migrations[sid] = task

        def done(t: asyncio.Task) -> None:
            if self.migrations.get(sid) is t:
                del self.migrations[sid]
        task.add_done_callback(done)
        return task

    async def _migrate(self, sid: str, dst: int, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        if self.location.get(sid, dst) == dst:
            return
        if sid in self._idle:                                      # a turn still runs on the holder
            await self._idle[sid].wait()
        src = self.location[sid]
        t0 = time.monotonic()
        try:
            payload = await self.clients[src].export(sid)
            await self.clients[dst].import_(payload)
        except Exception:                                          # the turn recomputes instead
            self.stats["migrations_failed"] += 1
            log.exception("migrating session %r from replica %s to %s failed",
                          sid, self.clients[src].name, self.clients[dst].name)
            return
        self.location[sid] = dst
        await self.clients[src].release(sid)
        self.stats["migrations"] += 1
        self.migration_seconds += time.monotonic() - t0

    async def wait_migrations(self) -> None:
        while self.migrations:
            await asyncio.gather(*self.migrations.values(), return_exceptions=True)

    # ---- state ----------------------------------------------------------------------------------

    async def metrics_page(self, accept: str | None = None) -> tuple[bytes, str]:
        """(/metrics page, content type): every replica's families, labelled with its replica, then the
        router's own. A replica that does not answer is left out and reported by router_replica_up."""
        snaps = await asyncio.gather(*(c.snapshot() for c in self.clients), return_exceptions=True)
        ok = {n: s for n, s in zip(self.names, snaps) if not isinstance(s, BaseException)}
        for n, s in zip(self.names, snaps):
            if isinstance(s, BaseException):
                log.warning("replica %s did not answer the metrics scrape: %r", n, s)
        self.metrics.unreachable = set(self.names) - set(ok)
        return render(merge(ok) + self.metrics.snapshot(), accept)

    async def metrics_text(self) -> str:
        """The page in the text format (0.0.4)."""
        return (await self.metrics_page())[0].decode()

    async def tenant_usage(self, tenant: str, keys: list[str]) -> dict:
        """A tenant's sessions and tokens over all replicas; `present`: {key: history tokens} of
        those of `keys` stored somewhere (the largest copy, should one be mid-migration)."""
        parts = await asyncio.gather(*(c.tenant_usage(tenant, keys) for c in self.clients))
        out = {f: sum(p[f] for p in parts) for f in ("sessions", "history_tokens", "stored_tokens")}
        out["present"] = {}
        for p in parts:
            for k, n in p["present"].items():
                out["present"][k] = max(n, out["present"].get(k, 0))
        return out

    async def health(self) -> list[dict]:
        return list(await asyncio.gather(*(c.health() for c in self.clients)))

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.clients))
