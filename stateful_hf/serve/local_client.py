"""`LocalClient`: a replica in this process, behind the async interface the router speaks to every replica.

The interface (`cluster.RayClient` implements the same for Ray Serve handles): `stream`, `hint`,
`session_tokens`, `tenant_usage`, `session_info`, `delete_session`, `export`, `import_`,
`release`, `snapshot`, `health`, `shutdown`. Owns nothing but its replica; blocking calls
(export, import, release, shutdown) run in a worker thread so the event loop never waits on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from .replica import Replica


class LocalClient:
    """A replica in this process."""

    def __init__(self, replica: Replica):
        self.replica, self.name = replica, replica.name

    def stream(self, session_id, prompt, sampling, *, cache_salt=None, tenant=None, fork=None,
               continues=None) -> AsyncIterator[dict]:
        return self.replica.stream(session_id, prompt, sampling, cache_salt=cache_salt, tenant=tenant, fork=fork,
                                   continues=continues)

    async def hint(self, session_id, expected_arrival, priority) -> dict:
        return self.replica.hint(session_id, expected_arrival, priority)

    async def session_tokens(self, session_id) -> int:
        return self.replica.session_tokens(session_id)

    async def tenant_usage(self, tenant, keys) -> dict:
        return self.replica.tenant_usage(tenant, keys)

    async def session_info(self, session_id) -> dict | None:
        return self.replica.session_info(session_id)

    async def delete_session(self, session_id) -> dict:
        return self.replica.delete_session(session_id)      # on the loop: atomic with the turn queue

    async def export(self, session_id):
        return await asyncio.to_thread(self.replica.export_session, session_id)

    async def import_(self, payload) -> dict:
        return await asyncio.to_thread(self.replica.import_session, payload)

    async def release(self, session_id) -> bool:
        return await asyncio.to_thread(self.replica.release_session, session_id)

    async def snapshot(self) -> list[dict]:
        return self.replica.snapshot()

    async def health(self) -> dict:
        return self.replica.health()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.replica.shutdown)
