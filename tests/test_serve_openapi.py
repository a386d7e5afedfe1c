"""Schemathesis over the server's own /openapi.json (tiny model, in-process server on 127.0.0.1): every
operation, a bounded number of generated requests each (valid and invalid, `mode` all), finds no 5xx,
no undeclared status or content type, and no response that violates its declared schema."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from stateful_hf.serve import ServerThread, build_local  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
EXAMPLES = 40             # per operation: 11 operations, ~20 s here
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server():
    # a small context and default max_tokens: generated requests run whole turns in milliseconds
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL, default_max_tokens=4, max_model_len=256)
    with ServerThread(app) as srv:
        yield srv
    for c in router.clients:
        c.replica.shutdown()


@pytest.fixture(scope="module")
def api_schema(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    # the fuzz names the served model (the document gives it as an example; another is a declared 404),
    # so that generated requests reach the engine rather than stopping at the model check
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "HintRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"const": MODEL}
    return schemathesis.openapi.from_dict(doc)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate], derandomize=True,
          suppress_health_check=list(HealthCheck), database=None)
def test_schemathesis_finds_no_5xx_and_no_schema_violation(case, server):
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)


def _boom(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("break_it", ["500", "schema"])
def test_the_checks_catch_a_5xx_and_a_schema_violation(api_schema, server, monkeypatch, break_it):
    """Negative controls: one valid chat request passes the checks; with a failure injected inside the
    app (a 500), or a reply missing its `choices` (a schema violation), the same request fails them."""
    from stateful_hf.serve import app as app_module
    case = api_schema["/v1/chat/completions"]["POST"].Case(
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        media_type="application/json")
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
    if break_it == "500":
        monkeypatch.setattr(app_module, "encode", _boom)
    else:
        real = app_module.chat_response
        monkeypatch.setattr(app_module, "chat_response", lambda *a, **k: {k: v for k, v in real(*a, **k).items()
                                                                          if k != "choices"})
    with pytest.raises(FailureGroup) as failed:
        case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
    kinds = {type(e).__name__ for e in failed.value.exceptions}
    assert kinds == ({"ServerError"} if break_it == "500" else {"JsonSchemaError"}), failed.value.exceptions
