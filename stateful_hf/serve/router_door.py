"""`RouterDoor`: the router as the app sees it (`app.py`, `responses.py`, `choices.answer`) and as its wrappers
see what they wrap. `Router` keeps it, and so do the wrappers the app stacks over it, each forwarding what it
does not change: `TenantGate` (limits.py: per-tenant limits on `stream`) and `SessionForks` (choices.py: a
session's n > 1 choices held on `stream` and `delete_session`). The router's other members (`clients`,
`names`, `metrics`, `shutdown`, ...) are its maker's, reached on the `Router` itself."""

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
