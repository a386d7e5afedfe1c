"""Request limits, and per-tenant admission (`TenantGate`, a wrapper of the `Router`).

- max_body_bytes: enforced by `auth.Guard` (413).
- max_prompt_tokens (None: the model's context): a longer prompt gets 400 `prompt_too_long`.
- max_sessions_per_tenant: a turn that would create a tenant's session beyond the limit gets 429
  `tenant_session_limit`. Sessions stay until deleted, so waiting does not help: no Retry-After.
- max_stored_tokens_per_tenant: the history tokens the server keeps for a tenant (all its sessions'
  token ids, whatever tier their KV is in). A turn is refused with 429 `tenant_token_limit` when
  the tenant's history after it could exceed the limit: the stores' history of the tenant, with
  each session that has a turn in flight (this one included) counted at its most (prompt +
  max_tokens) instead of its current length. When the turns in flight are what makes it exceed
  (they may well end shorter than max_tokens), the 429 carries `Retry-After`; otherwise it does not.

Admission is atomic per tenant: under the tenant's lock the replicas are asked about the tenant and
about its sessions with turns in flight, then the turn is checked and reserved; so concurrent turns
cannot overshoot a limit together, and no session is counted twice. The lock covers the question,
not the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from ..cache.sessions.tenant import split_key
from ..engine import SamplingParams
from .protocol import APIError
from .router_door import RouterDoor, RouterWrapper

RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 8 * 2**20
    max_prompt_tokens: int | None = None
    max_sessions_per_tenant: int | None = None
    max_stored_tokens_per_tenant: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_tokens", "max_sessions_per_tenant", "max_stored_tokens_per_tenant"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")

    def check_prompt(self, tokens: int, context: int, param: str) -> None:
        limit = self.max_prompt_tokens if self.max_prompt_tokens is not None else context
        if tokens > limit:
            raise APIError(400, f"the prompt has {tokens} tokens; this server accepts at most {limit} "
                           "(--max-prompt-tokens)", param=param, code="prompt_too_long")


class LimitError(APIError):
    """A 429, with Retry-After where waiting helps."""

    def __init__(self, message: str, code: str, retry_after: int | None):
        super().__init__(429, message, type="rate_limit_error", param="session_id", code=code,
                         retry_after=retry_after)


class TenantGate(RouterWrapper):
    """A `RouterDoor` over the router, with per-tenant session and stored-token limits on `stream`; the
    rest forwarded. `_flight[tenant]`: {session key: [turns in flight, most tokens after them]}."""

    def __init__(self, router: RouterDoor, limits: Limits):
        super().__init__(router)
        self.limits = limits
        self._flight: dict[str, dict[str, list[int]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}        # one per tenant seen (kept)

    @property
    def active(self) -> bool:
        return self.limits.max_sessions_per_tenant is not None or self.limits.max_stored_tokens_per_tenant is not None

    async def stream(self, session_id: str | None, prompt: list[int], sampling: SamplingParams,
                     **scope: str | None) -> AsyncGenerator[dict, None]:
        """`scope`: `cache_salt`, and `tenant` of a throwaway session (passed on to the router)."""
        if session_id is None or not self.active:
            async with contextlib.aclosing(self.router.stream(session_id, prompt, sampling, **scope)) as events:
                async for ev in events:
                    yield ev
            return
        tenant = split_key(session_id)[0]
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            await self._admit(tenant, session_id, len(prompt) + sampling.max_new_tokens)
        try:
            async with contextlib.aclosing(self.router.stream(session_id, prompt, sampling, **scope)) as events:
                async for ev in events:
                    yield ev
        finally:
            flight = self._flight[tenant]
            entry = flight[session_id]
            entry[0] -= 1
            if not entry[0]:
                del flight[session_id]
                if not flight:
                    del self._flight[tenant]

    async def _admit(self, tenant: str, sid: str, most: int) -> None:
        flight = {k: tuple(v) for k, v in self._flight.get(tenant, {}).items()}   # as asked (turns may end)
        usage = await self.router.tenant_usage(tenant, [sid, *flight])
        present = usage["present"]                                 # {key: history tokens} of stored ones
        lim = self.limits
        if lim.max_sessions_per_tenant is not None and sid not in present and sid not in flight:
            new = sum(1 for k in flight if k not in present)
            if usage["sessions"] + new + 1 > lim.max_sessions_per_tenant:
                raise LimitError(f"this API key's tenant has {usage['sessions'] + new} sessions, the most this "
                                 f"server keeps per tenant (--max-sessions-per-tenant "
                                 f"{lim.max_sessions_per_tenant}); delete one or continue an existing one",
                                 "tenant_session_limit", None)
        if lim.max_stored_tokens_per_tenant is not None:
            limit = lim.max_stored_tokens_per_tenant
            base = usage["history_tokens"] - sum(present.get(k, 0) for k in {sid, *flight})
            mine = max(most, present.get(sid, 0), flight.get(sid, (0, 0))[1])
            others = sum(max(m, present.get(k, 0)) for k, (_, m) in flight.items() if k != sid)
            if base + others + mine > limit:
                settled = base + sum(present.get(k, 0) for k in flight if k != sid) + mine
                wait = RETRY_AFTER_SECONDS if settled <= limit else None
                raise LimitError(f"this turn could bring the history this server keeps for this API key's tenant "
                                 f"to {base + others + mine} tokens, over the limit of {limit} "
                                 "(--max-stored-tokens-per-tenant); "
                                 + ("retry when the turns in flight have ended" if wait else
                                    "delete sessions, or send shorter prompts or a lower max_tokens"),
                                 "tenant_token_limit", wait)
        entry = self._flight.setdefault(tenant, {}).setdefault(sid, [0, 0])
        entry[0] += 1
        entry[1] = max(entry[1], most)
