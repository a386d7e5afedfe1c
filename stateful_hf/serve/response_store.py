"""Stored responses of the Responses API (`responses.py`), per tenant, with a time to live and a cap.

A stored response keeps what a continuation needs: the conversation through it (`messages`: the
chain's input and output items as chat-template messages, without instructions: OpenAI does not carry
them over), the session whose KV holds that conversation and the key of the prompt it ran on
(`PromptKey`). The first continuation of a response whose prompt extends that prompt *claims* its
session and runs there, so only its new input is prefilled; any other continuation forks: it runs in a
new session, which starts from the shared prefix the store holds (docs/prefix-sharing.md). A
continuation whose prompt does not extend the response's (other `instructions` or tools, truncation)
therefore never cuts the session's history: every stored response stays continuable with its KV
reused, whatever other continuations of it did (invariant: each stored response's prompt is a prefix of
its session's history; a claim may re-render only the reply after it, as every continuation of that
response with the same prompt would). A response past its TTL, or the oldest one past the cap, is
forgotten; the session it held is returned to the caller (`put`, `delete`) to be deleted when nothing
else can use it. A background response (`responses.py`) is stored while it runs, without `messages`
(not continuable), and stored again when it ends: with its reply, or without one (cancelled, failed:
never continuable; its session is then returned to be deleted as above).
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_TTL = 3600.0          # seconds a stored response can be fetched and continued
DEFAULT_CAP = 10_000          # stored responses at most (all tenants); the oldest go first


@dataclass(frozen=True, slots=True)
class ResponseRetention:
    """How long and how many stored responses are kept (`--responses-ttl`, `--responses-cap`)."""

    ttl: float = DEFAULT_TTL      # seconds from storing until a response is forgotten
    cap: int = DEFAULT_CAP        # stored responses at most, all tenants together

    def __post_init__(self) -> None:
        if isinstance(self.ttl, bool) or not isinstance(self.ttl, int | float) or not self.ttl > 0:
            raise ValueError(f"responses_ttl must be a number of seconds > 0, got {self.ttl!r}")
        if isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 1:
            raise ValueError(f"responses_cap must be an int >= 1, got {self.cap!r}")


@dataclass(frozen=True, slots=True)
class PromptKey:
    """A prompt's length and digest (BLAKE2b of its ids as int64): whether another prompt starts with
    it, in O(length) without keeping the ids (a stored response holds 24 bytes, not its prompt)."""

    length: int
    digest: bytes

    @classmethod
    def of(cls, ids) -> PromptKey:
        return cls(len(ids), hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest())

    def prefixes(self, ids) -> bool:
        """Whether `ids` starts with the prompt this key was made of."""
        return len(ids) >= self.length and PromptKey.of(ids[:self.length]) == self


@dataclass
class StoredResponse:
    id: str
    tenant: str
    session: str                   # the store key of the session whose history ends with this response
    owns_session: bool             # the server named the session (not the client's X-Session-Id)
    messages: list[dict] | None    # the conversation through this response (no instructions); None: no reply
                                   # to continue (a background response running, cancelled or failed)
    body: dict                     # the response object, as returned
    created: float = field(default_factory=time.time)
    claimed: bool = False          # a continuation has run in `session` (later ones fork)
    prompt: PromptKey | None = None   # the prompt this response ran on (None: unknown, never claimed)

    @property
    def heads(self) -> bool:
        """Whether the end of its session's history is this response's, for a continuation to claim."""
        return self.messages is not None and not self.claimed

    @property
    def running(self) -> bool:
        """A background response not ended yet (its turn may hold its session)."""
        return self.body.get("status") in ("queued", "in_progress")


class ResponseStore:
    """Stored responses by (tenant, id); thread-safe (worker threads resolve, the event loop stores).
    Kept in the order stored, each with its deadline (stored + ttl, monotonic clock), so that the
    expired ones are a prefix; `_heads` counts the unclaimed stored responses per session. Each
    operation is O(1) amortised, whatever the number stored."""

    def __init__(self, retention: ResponseRetention | None = None, clock: Callable[[], float] = time.monotonic):
        self.retention = retention or ResponseRetention()
        self._clock = clock
        self._items: OrderedDict[tuple[str, str], tuple[float, StoredResponse]] = OrderedDict()  # key -> (deadline, r)
        self._heads: Counter[str] = Counter()     # session -> unclaimed stored responses whose history it holds
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        """The tenant's stored response `rid` (None: unknown, another tenant's, or expired)."""
        with self._lock:
            item = self._items.get((tenant, rid))
            return None if item is None or item[0] <= self._clock() else item[1]

    def claim(self, r: StoredResponse, ids) -> bool:
        """True for the first continuation of `r` whose prompt `ids` extends r's (it runs in r's
        session); False otherwise (a fork, which leaves r's session as it is)."""
        with self._lock:
            if r.claimed or r.prompt is None or not r.prompt.prefixes(ids):
                return False
            first, r.claimed = True, True
            if first and self._items.get((r.tenant, r.id), (0, None))[1] is r:
                self._unhead(r.session)
            return first

    def put(self, r: StoredResponse) -> list[str]:
        """Store `r` (replacing the one of its id); returns the sessions to delete: those of the
        responses dropped to make room or expired, and r's own when it has ended without a reply,
        each where no stored response still heads it."""
        with self._lock:
            key = (r.tenant, r.id)
            gone = [] if key not in self._items else [self._pop(key)]
            self._items[key] = (self._clock() + self.retention.ttl, r)
            if r.heads:
                self._heads[r.session] += 1
            if r.messages is None:
                gone.append(r)
            now = self._clock()
            while self._items:
                first, (deadline, _) = next(iter(self._items.items()))
                if deadline > now and len(self._items) <= self.retention.cap:
                    break
                gone.append(self._pop(first))
            return self._orphans(gone)

    def delete(self, tenant: str, rid: str) -> tuple[StoredResponse | None, list[str]]:
        """Forget the tenant's response `rid`: (it or None, the sessions to delete)."""
        with self._lock:
            item = self._items.get((tenant, rid))
            if item is None:
                return None, []
            r = self._pop((tenant, rid))
            return (None if item[0] <= self._clock() else r), self._orphans([r])

    def _pop(self, key: tuple[str, str]) -> StoredResponse:
        r = self._items.pop(key)[1]
        if r.heads:
            self._unhead(r.session)
        return r

    def _unhead(self, session: str) -> None:
        self._heads[session] -= 1
        if not self._heads[session]:
            del self._heads[session]

    def _orphans(self, gone: list[StoredResponse]) -> list[str]:
        """Sessions the server named for responses in `gone`, never continued nor running, that no stored
        response heads."""
        return sorted({r.session for r in gone if r.owns_session and not r.claimed and not r.running
                       and r.session not in self._heads})
