"""`X-Session-Retain: seconds`: an agent pausing for a tool says when its next turn comes.

Sent with a turn, it sets the same field as a hint's `expected_arrival` once the turn has ended: the
replica holding the session ranks its KV for eviction as if it were active that many seconds later
(`KVStore.expect`; clamped to `--max-retain`). A soft priority that decays as newer activity passes it,
counted in its tenant's share like any stored token, and never a pin: a retained session never blocks
anyone's admission. A negative, non-finite or non-numeric value is a 400 naming the header.
"""

from __future__ import annotations

import math

from starlette.requests import Request

from .protocol import APIError

RETAIN_HEADER = "X-Session-Retain"


def retain_of(request: Request) -> float | None:
    """The request's `X-Session-Retain` seconds, None without the header; APIError(400) when it is bad."""
    raw = request.headers.get(RETAIN_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise APIError(400, f"{RETAIN_HEADER} must be a number of seconds >= 0, got {raw[:40]!r}",
                       param=RETAIN_HEADER, code="invalid_value")
    return seconds
