"""`RouterDoor`: the router as the app sees it (`app.py`, `responses.py`, `choices.answer`) and as its wrappers
see what they wrap. `Router` keeps it, and so do the wrappers the app stacks over it, each forwarding what it
does not change through `RouterWrapper`: `TenantGate` (limits.py: per-tenant limits on `stream`) and
`SessionForks` (choices.py: a session's n > 1 choices held on `stream` and `delete_session`). The router's
other members (`clients`, `names`, `metrics`, `shutdown`, ...) are its maker's, reached on the `Router` itself."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..engine import SamplingParams


class RouterDoor(Protocol):
    """Turns, sessions, hints and the router's pages. Each method is a coroutine, except `stream` (an async
    generator of the turn's events); a refusal raises `APIError` (its HTTP status)."""

    def stream(self, session_id: str | None, prompt: list[int], sampling: SamplingParams, *,
               cache_salt: str | None = None, tenant: str | None = None,
               fork: str | None = None, continues: str | None = None) -> AsyncGenerator[dict, None]:
        """Runs one turn of the session (None: a throwaway one of `tenant`) on a replica: its events, "done" or
        "error" last. Changes the session's history and KV, and where the router holds it."""
        ...

    async def delete_session(self, sid: str) -> dict:
        """Changes: deletes the session on its holder (404: none; 409: a turn of it in flight or queued)."""
        ...

    async def session_info(self, sid: str) -> dict:
        """Reads the session's description on its holder (404: none)."""
        ...

    async def hint(self, session_id: str, expected_arrival: float | None = None,
                   priority: int | None = None) -> dict:
        """Changes the plan: the session's next turn goes to the replica named in the answer (its KV moved
        there if need be)."""
        ...

    async def retain(self, session_id: str, seconds: float) -> None:
        """Changes the holder's ranking: the session's KV is ranked to stay `seconds` (`X-Session-Retain`)."""
        ...

    async def tenant_usage(self, tenant: str, keys: list[str]) -> dict:
        """Reads the tenant's sessions and tokens over all replicas; `present`: those of `keys` stored."""
        ...

    async def metrics_page(self, accept: str | None = None) -> tuple[bytes, str]:
        """Reads every replica's metrics and the router's own: (the /metrics page, its content type)."""
        ...

    async def health(self) -> list[dict]:
        """Reads each replica's health."""
        ...


class RouterWrapper:
    """A `RouterDoor` over another (`router`) that forwards every member; a wrapper overrides what it changes."""

    def __init__(self, router: RouterDoor):
        self.router = router

    def stream(self, session_id: str | None, prompt: list[int], sampling: SamplingParams,
               **scope: str | None) -> AsyncGenerator[dict, None]:
        """`RouterDoor.stream`: runs one turn (`scope`: cache_salt, tenant, fork, continues)."""
        return self.router.stream(session_id, prompt, sampling, **scope)

    async def delete_session(self, sid: str) -> dict:
        """`RouterDoor.delete_session`: deletes the session on its holder."""
        return await self.router.delete_session(sid)

    async def session_info(self, sid: str) -> dict:
        """`RouterDoor.session_info`: reads the session's description."""
        return await self.router.session_info(sid)

    async def hint(self, session_id: str, expected_arrival: float | None = None, priority: int | None = None) -> dict:
        """`RouterDoor.hint`: plans the session's next turn's replica."""
        return await self.router.hint(session_id, expected_arrival, priority)

    async def retain(self, session_id: str, seconds: float) -> None:
        """`RouterDoor.retain`: ranks the session's KV to stay on its holder."""
        await self.router.retain(session_id, seconds)

    async def tenant_usage(self, tenant: str, keys: list[str]) -> dict:
        """`RouterDoor.tenant_usage`: reads the tenant's sessions and tokens."""
        return await self.router.tenant_usage(tenant, keys)

    async def metrics_page(self, accept: str | None = None) -> tuple[bytes, str]:
        """`RouterDoor.metrics_page`: reads the /metrics page."""
        return await self.router.metrics_page(accept)

    async def health(self) -> list[dict]:
        """`RouterDoor.health`: reads each replica's health."""
        return await self.router.health()
