"""The ASGI middleware that turns an unexpected exception into a clean 500 (`ErrorBoundary`).

An exception no handler knows (a bug: client errors are `APIError`s) is logged with its traceback and a
request id (logger `stateful_hf.errors`, record field `request_id`), and the client gets OpenAI's
500 shape carrying that id (in the message and the `X-Request-Id` header) and nothing of the
exception. The exception is not raised further: Starlette's outermost handler would re-raise it and
uvicorn would then drop the keep-alive connection without `Connection: close`, failing the next
request sent on it (another client's, behind a pooling proxy). A response that had already started
(a stream) is ended cleanly instead, a server-sent-event stream with an `error` event first.
A turn's unexpected engine error reaches the client as an error event, not an exception: `logged`
gives it the same treatment (replica.py).
"""

from __future__ import annotations

import json
import logging
import uuid

from .protocol import APIError

log = logging.getLogger("stateful_hf.errors")


def internal_error(request_id: str) -> APIError:
    """The 500 a client sees: a generic message and the id its log record carries."""
    return APIError(500, f"The server had an error while processing your request; it is logged with the request "
                    f"id {request_id}.", type="server_error", code="internal_error")


def logged(e: BaseException, where: str) -> APIError:
    """The 500 of an unexpected exception `e` caught `where` (a turn's engine error: replica.py),
    logged here with its traceback and the id the 500 carries."""
    rid = new_request_id()
    log.error("unexpected error in %s (request id %s): %s: %s", where, rid, type(e).__name__, e, exc_info=e,
              extra={"request_id": rid})
    return internal_error(rid)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


class ErrorBoundary:
    """Around the app (inside auth and CORS, so their headers still apply). `on_error(e)` is told of
    each 500 (the error counter)."""

    def __init__(self, app, on_error=None):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, event_stream = False, False

        async def tracked(message):
            nonlocal started, event_stream
            if message["type"] == "http.response.start":
                started = True
                event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:   # noqa: BLE001 - the point: whatever a bug raises
            rid = new_request_id()
            log.exception("unexpected error answering %s %s (request id %s)", scope.get("method"), scope.get("path"),
                          rid, extra={"request_id": rid})
            e = internal_error(rid)
            if self.on_error is not None:
                self.on_error(e)
            try:
                if not started:
                    body = json.dumps(e.body()).encode()
                    await send({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()),
                                            (b"x-request-id", rid.encode())]})
                    await send({"type": "http.response.body", "body": body})
                else:
                    tail = f"data: {json.dumps(e.body())}\n\n".encode() if event_stream else b""
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
            except OSError:      # the client went away meanwhile
                pass
