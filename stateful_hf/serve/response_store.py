"""Stored responses of the Responses API (`responses.py`), per tenant, with a time to live and a cap.

A stored response keeps what a continuation needs: the conversation through it (`messages`: the
chain's input and output items as chat-template messages, without instructions: OpenAI does not carry
them over) and the session whose KV holds that conversation. The first continuation of a response
*claims* its session and runs there, so only its new input is prefilled; any later continuation of the
same response forks: it runs in a new session, which starts from the shared prefix the store holds
(docs/prefix-sharing.md). A response past its TTL, or the oldest one past the cap, is forgotten; the
session it held is returned to the caller (`put`, `delete`) to be deleted when nothing else can use it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_TTL = 3600.0          # seconds a stored response can be fetched and continued
DEFAULT_CAP = 10_000          # stored responses at most (all tenants); the oldest go first


@dataclass
class StoredResponse:
    id: str
    tenant: str
    session: str                   # the store key of the session whose history ends with this response
    owns_session: bool             # the server named the session (not the client's X-Session-Id)
    messages: list[dict]           # the conversation through this response (no instructions)
    body: dict                     # the response object, as returned
    created: float = field(default_factory=time.time)
    claimed: bool = False          # a continuation has run in `session` (later ones fork)


class ResponseStore:
    """Stored responses by (tenant, id); thread-safe (worker threads resolve, the event loop stores)."""

    def __init__(self, ttl: float = DEFAULT_TTL, cap: int = DEFAULT_CAP):
        if ttl <= 0 or cap < 1:
            raise ValueError(f"ttl must be > 0 and cap >= 1, got {ttl}, {cap}")
        self.ttl, self.cap = ttl, cap
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        """The tenant's stored response `rid` (None: unknown, another tenant's, or expired)."""
        with self._lock:
            r = self._items.get((tenant, rid))
            return None if r is None or self._expired(r) else r

    def claim(self, r: StoredResponse) -> bool:
        """True for the first continuation of `r` (it runs in r's session); False after (a fork)."""
        with self._lock:
            first, r.claimed = not r.claimed, True
            return first

    def put(self, r: StoredResponse) -> list[str]:
        """Store `r`; returns the sessions of the responses dropped to make room or expired that no
        stored response still heads (to delete)."""
        with self._lock:
            self._items[(r.tenant, r.id)] = r
            dropped = [k for k, v in self._items.items() if self._expired(v)]
            dropped += [k for k in self._items if k not in dropped][:max(0, len(self._items) - len(dropped) - self.cap)]
            return self._forget(dropped)

    def delete(self, tenant: str, rid: str) -> tuple[StoredResponse | None, list[str]]:
        """Forget the tenant's response `rid`: (it or None, the sessions to delete)."""
        with self._lock:
            r = self._items.get((tenant, rid))
            if r is None or self._expired(r):
                return None, self._forget([(tenant, rid)] if r is not None else [])
            return r, self._forget([(tenant, rid)])

    def _forget(self, keys: list[tuple[str, str]]) -> list[str]:
        gone = [self._items.pop(k) for k in keys if k in self._items]
        heads = {v.session for v in self._items.values() if not v.claimed}
        return sorted({r.session for r in gone if r.owns_session and not r.claimed and r.session not in heads})

    def _expired(self, r: StoredResponse) -> bool:
        return time.time() - r.created > self.ttl
