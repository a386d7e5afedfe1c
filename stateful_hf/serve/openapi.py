"""The server's OpenAPI document (`GET /openapi.json`), with every request body and error response.

The routes read their bodies themselves (`request_body.parse`, in a worker thread: the event loop keeps
answering), so FastAPI does not see the request models; `install` declares them here, from the same
pydantic models, and each operation's responses: its success (JSON, or server-sent events for a
stream) and the errors it can answer, all in OpenAI's error shape (`Error`). The success bodies are
described loosely (their required keys and types); the request models are the ones that validate.
"""

from __future__ import annotations

import re

from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from .protocol import ChatCompletionRequest, CompletionRequest, HintRequest
from .responses import ResponsesRequest
from .utility import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# what each error status means here (docs/server-api.md)
STATUS = {"400": "invalid request: `param` names the field or header at fault", "401": "missing or unknown API key",
          "404": "unknown model, session or response", "409": "the session has a turn in flight (Retry-After)",
          "413": "the body is larger than --max-body-bytes", "429": "a tenant limit (Retry-After where waiting helps)",
          "500": "a server bug: a generic message with the request id it is logged under",
          "503": "an engine is not running"}

_OBJECT = {"type": "object"}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
RESPONSES = {   # success bodies, by component name
    "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion"},
                                      "created": {"type": "integer"}, "model": {"type": "string"},
                                      "choices": {"type": "array", "items": {
                                          "type": "object", "required": ["index", "message", "finish_reason"],
                                          "properties": {"index": {"type": "integer"}, "message": _OBJECT}}},
                                      "usage": _USAGE}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"},
                                  "created": {"type": "integer"}, "model": {"type": "string"},
                                  "choices": {"type": "array", "items": {
                                      "type": "object", "required": ["index", "text", "finish_reason"],
                                      "properties": {"index": {"type": "integer"}, "text": {"type": "string"}}}},
                                  "usage": _USAGE}},
    "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                 "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                "created_at": {"type": "integer"}, "status": {"type": "string"},
                                "model": {"type": "string"}, "output": {"type": "array", "items": _OBJECT}}},
    "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                        "properties": {"id": {"type": "string"}, "object": {"const": "response.deleted"},
                                       "deleted": {"type": "boolean"}}},
    "Hint": {"type": "object", "required": ["session_id", "replica", "migrating"],
             "properties": {"session_id": {"type": "string"}, "replica": {"type": "string"},
                            "migrating": {"type": "boolean"}}},
    "Session": {"type": "object", "required": ["id", "object", "tokens", "tiers"],
                "properties": {"id": {"type": "string"}, "object": {"const": "session"},
                               "tokens": {"type": "integer"}, "tiers": _OBJECT}},
    "SessionDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                       "properties": {"id": {"type": "string"}, "object": {"const": "session.deleted"},
                                      "deleted": {"type": "boolean"}}},
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                      "type": "object", "required": ["id", "object"], "properties": {"id": {"type": "string"}}}}}},
    "ServerSentEvent": {"type": "object", "required": ["data"], "description": "one event of a stream (OpenAPI 3.1: "
                        "`schema` describes each event)",
                        "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                                       "data": {"type": "string", "description": "a JSON object (a chunk, an "
                                                "event or an error), or `[DONE]` ending a chat or completion "
                                                "stream"}}},
    "Tokenized": {"type": "object", "required": ["count", "max_model_len", "tokens"],
                  "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                 "tokens": {"type": "array", "items": {"type": "integer"}},
                                 "token_strs": {"type": "array", "items": {"type": "string"}}}},
    "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "Version": {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
    "Health": {"type": "object", "required": ["status", "model", "replicas"],
               "properties": {"status": {"enum": ["ok", "unhealthy"]}, "model": {"type": "string"},
                              "replicas": {"type": "array"}}},
}
_TURN = ("400", "401", "404", "409", "413", "429", "500")
_STREAMS = {"text/event-stream": {"schema": {"$ref": REF.format(model="ServerSentEvent")}}}   # each event
# (method, path) -> (request model, success component, streams, error statuses)
OPERATIONS = {
    ("post", "/v1/chat/completions"): (ChatCompletionRequest, "ChatCompletion", True, _TURN),
    ("post", "/v1/completions"): (CompletionRequest, "Completion", True, _TURN),
    ("post", "/v1/responses"): (ResponsesRequest, "Response", True, _TURN),
    ("get", "/v1/responses/{response_id}"): (None, "Response", False, ("401", "404", "500")),
    ("delete", "/v1/responses/{response_id}"): (None, "ResponseDeleted", False, ("401", "404", "500")),
    ("post", "/v1/responses/{response_id}/cancel"): (None, "Response", False, ("400", "401", "404", "500")),
    ("post", "/v1/hints"): (HintRequest, "Hint", False, ("400", "401", "404", "413", "500")),
    ("get", "/v1/sessions/{session_id}"): (None, "Session", False, ("400", "401", "404", "500")),
    ("delete", "/v1/sessions/{session_id}"): (None, "SessionDeleted", False, ("400", "401", "404", "409", "500")),
    ("get", "/v1/models"): (None, "ModelList", False, ("401", "500")),
    ("get", "/metrics"): (None, None, False, ("401", "500")),
    ("get", "/health"): (None, "Health", False, ("500",)),
    ("post", "/tokenize"): (TokenizeRequest, "Tokenized", False, ("400", "401", "404", "413", "500")),
    ("post", "/detokenize"): (DetokenizeRequest, "Detokenized", False, ("400", "401", "404", "413", "500")),
    ("get", "/version"): (None, "Version", False, ("401", "500")),
    ("get", "/ping"): (None, "", False, ("500",)),
    ("post", "/ping"): (None, "", False, ("500",)),
}


REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, HintRequest, ResponsesRequest,
                  TokenizeRequest)


def document(app, model_name: str, session_id: re.Pattern) -> dict:
    """The OpenAPI document of `app` (`create_app`'s), serving `model_name`; `session_id`: what a session
    id is (app.SESSION_ID)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of stateful-hf (docs/server-api.md)")
    models = REQUEST_MODELS
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    schemas.update({"Error": ERROR, **RESPONSES})
    for m in models:                                # the served model: an example, not a constraint
        model_field = schemas[m.__name__].get("properties", {}).get("model")
        if model_field is not None:
            model_field["examples"] = [model_name]
    for (method, path), (body, success, streams, errors) in OPERATIONS.items():
        op = doc["paths"][path][method]
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "$ref": REF.format(model=body.__name__)}}}}
        if success is None:                         # /metrics: Prometheus or OpenMetrics text
            ok = {"text/plain": {"schema": {"type": "string"}},
                  "application/openmetrics-text": {"schema": {"type": "string"}}}
        elif success == "":                         # /ping: an empty body, the status is the answer
            ok = {}
        else:
            ok = {"application/json": {"schema": {"$ref": REF.format(model=success)}}, **(_STREAMS if streams else {})}
        op["responses"] = {"200": {"description": "OK" + (" (server-sent events with `stream: true`)" if streams
                                                           else ""), **({"content": ok} if ok else {})},
                           **{s: {"description": STATUS[s], "content": {"application/json": {"schema": {
                               "$ref": REF.format(model="Error")}}}} for s in errors}}
        if path == "/ping":
            op["responses"]["503"] = {"description": STATUS["503"]}
        if path == "/health":
            op["responses"]["503"] = {"description": STATUS["503"], "content": {"application/json": {"schema": {
                "$ref": REF.format(model="Health")}}}}
    for ops in doc["paths"].values():              # a session id in the URL
        for op in ops.values():
            for param in op.get("parameters", ()):
                if param["name"] == "session_id":
                    param["schema"] = {"type": "string", "pattern": f"^{session_id.pattern}$"}
    schemas.pop("HTTPValidationError", None)        # FastAPI's 422: never answered (no typed parameters fail)
    schemas.pop("ValidationError", None)
    return doc


def install(app, model_name: str, session_id: re.Pattern) -> None:
    """`app.openapi()` (what /openapi.json serves) returns `document(app, ...)`, made once."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, model_name, session_id)
        return app.openapi_schema
    app.openapi = openapi
