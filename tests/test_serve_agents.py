"""SmolLM2-135M-Instruct served by `python -m stateful_hf.serve --dtype float32` (its own chat template
renders no tools: the shipped ChatML tool template is used), through real clients: the OpenAI Agents
SDK (an Agent with a function tool on its chat-completions model and on its Responses model, the call
forced, sessions named through extra_headers X-Session-Id), the `openai` client's forced tool call
streamed and not, and a Responses continuation whose answer equals the whole conversation sent again
without reuse. Time: about 2 minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")

from agent_server import serve  # noqa: E402

from stateful_hf.models import DEFAULT_MODEL, is_fetched  # noqa: E402

pytestmark = pytest.mark.real_model
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    if not is_fetched(DEFAULT_MODEL):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {DEFAULT_MODEL} is not fetched")
        pytest.skip(f"{DEFAULT_MODEL} is not fetched (python -m stateful_hf.models fetch)")
    with serve(tmp_path_factory.mktemp("agents"), "--model", DEFAULT_MODEL) as u:
        yield u


def test_an_agent_calls_its_tool_on_both_models(url):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        calls.append(city)
        return f"It is sunny and 22 degrees in {city}."

    async def run_both():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        out = {}
        for model in (OpenAIChatCompletionsModel(DEFAULT_MODEL, client), OpenAIResponsesModel(DEFAULT_MODEL, client)):
            kind = type(model).__name__
            settings = ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0,
                                     max_tokens=80, extra_headers={"X-Session-Id": f"agent-{kind}"})
            agent = Agent(name="weather", instructions="You answer questions about the weather. Use the tools.",
                          tools=[get_weather], model=model, model_settings=settings)
            out[kind] = await Runner.run(agent, ASK)
        return out

    results = asyncio.run(run_both())
    assert calls == ["Paris", "Paris"]                            # once per model: the forced call ran the tool
    for kind, result in results.items():
        kinds = [type(i).__name__ for i in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kind
        assert "22 degrees" in result.final_output, (kind, result.final_output)    # the tool's output was read
        second = result.raw_responses[-1].usage
        assert second.input_tokens_details.cached_tokens > 0, kind    # the session (X-Session-Id) was reused


def test_a_forced_call_streamed_and_not(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # (without a system turn SmolLM2 leaves the call's outer brace open: the reply is then text, until
    # constrained decoding writes the call)
    system = {"role": "system", "content": "You answer questions about the weather. Use the tools."}
    kw = dict(model=DEFAULT_MODEL, messages=[system, {"role": "user", "content": ASK}], tools=[WEATHER], temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    args = "".join(d.function.arguments or "" for chunk in client.chat.completions.create(**kw, stream=True)
                   for ch in chunk.choices for d in ch.delta.tool_calls or [] if d.function)
    assert args == call.function.arguments


def test_a_responses_continuation_is_exact(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kw = dict(model=DEFAULT_MODEL, instructions="You are a concise assistant.", temperature=0, max_output_tokens=40)
    first = client.responses.create(input="What is the capital of France?", **kw)
    second = client.responses.create(input="And what river flows through it?", previous_response_id=first.id, **kw)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    whole = [{"role": "user", "content": "What is the capital of France?"},
             *[o.model_dump(exclude_none=True) for o in first.output],
             {"role": "user", "content": "And what river flows through it?"}]
    oracle = client.responses.create(input=whole, store=False, extra_body={"cache_salt": "oracle"}, **kw)
    assert oracle.usage.input_tokens_details.cached_tokens == 0
    assert second.output_text == oracle.output_text and second.output_text


def test_an_answer_after_a_tool_result_carries_no_template_tags(url):
    """SmolLM2 imitates the `<tool_response>` wrapper of the tool result it just read and starts its answer
    with it (the raw completion of the same prompt shows it: the negative control); the reply parser strips
    the template's tool-result tags (result_tags.py), in chat (streamed or not, also with tool_choice none)
    and in the Responses API."""
    from transformers import AutoTokenizer

    from stateful_hf.models import model_dir
    from stateful_hf.serve import tools as tool_mod

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "system", "content": "You answer questions about the weather. Use the tools."},
               {"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "It is sunny and 22 degrees in Paris."}]
    tok = AutoTokenizer.from_pretrained(model_dir(DEFAULT_MODEL))
    prompt = tool_mod.render(tok, history, tool_mod.plan(tok, [WEATHER], "auto", True))
    raw = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    assert raw.startswith("<tool_response>") and "22 degrees" in raw          # what the model writes
    expected = raw.removeprefix("<tool_response>\n").split("</tool_response>")[0].strip()
    for choice in ("auto", "none"):
        kw = dict(model=DEFAULT_MODEL, messages=history, tools=[WEATHER], tool_choice=choice, max_tokens=30,
                  temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(ch.delta.content or "" for chunk in client.chat.completions.create(**kw, stream=True)
                           for ch in chunk.choices)
        assert whole.strip() == expected and streamed == whole, (choice, whole, streamed)
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "It is sunny and 22 degrees in Paris."}]
    r = client.responses.create(model=DEFAULT_MODEL, input=items, instructions=history[0]["content"],
                                tools=[{"type": "function", **WEATHER["function"]}], temperature=0,
                                max_output_tokens=30)
    assert "<tool_response>" not in r.output_text and "22 degrees" in r.output_text, r.output_text
