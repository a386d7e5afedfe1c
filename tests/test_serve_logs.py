"""Structured logs: one `request_end` record per turn (session, tokens reused / restored per tier /
recomputed / generated, TTFT, finish reason), no prompt text unless asked; JSON lines with
--log-format json."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

pytest.importorskip("fastapi")

from stateful_hf import SamplingParams  # noqa: E402
from stateful_hf.serve import LocalClient, Replica, Router  # noqa: E402
from stateful_hf.serve.logs import configure, env, formatter  # noqa: E402
from stateful_hf.serve.server import EngineOptions  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

SECRET = "Tell me about the purple lighthouse"


def _run(turns: int = 2) -> tuple[list[dict], Replica]:
    tok = tiny_tokenizer()
    replica = Replica(EngineOptions(device_capacity=64, host_capacity=4096, chunk_size=8).build(tiny_llama(), tok),
                      name="r0")
    router = Router([LocalClient(replica)])
    convs = {f"s{i}": tok(f"{SECRET} number {i}, please, in detail.", add_special_tokens=False)["input_ids"]
             for i in range(4)}

    async def main():
        finals = []
        for _ in range(turns):
            for sid, ids in convs.items():
                final = None
                async for ev in router.stream(sid, ids, SamplingParams(max_new_tokens=3)):
                    final = ev
                finals.append(final)
                convs[sid] = ids + final["token_ids"] + [7, 11, 15]
        async for _ in router.stream(None, [3, 4, 5], SamplingParams(max_new_tokens=2)):
            pass
        return finals

    return asyncio.run(main()), replica


def test_one_request_end_record_per_turn_with_tiers_and_no_prompt(caplog, monkeypatch):
    monkeypatch.delenv("STATEFUL_HF_LOG_PROMPTS", raising=False)
    with caplog.at_level(logging.INFO, logger="stateful_hf.requests"):
        finals, replica = _run()
    try:
        recs = [r for r in caplog.records if r.name == "stateful_hf.requests"]
        assert len(recs) == len(finals) + 1                              # + the throwaway session's turn
        assert all(r.event == "request_end" for r in recs)
        assert recs[-1].session_id is None                               # a throwaway session has no id to log
        for rec, final in zip(recs, finals):
            assert rec.finish_reason == final["finish_reason"] and rec.replica == "r0"
            assert rec.reused_tokens == final["reused_tokens"] and rec.recomputed_tokens == final["recomputed_tokens"]
            assert rec.generated_tokens == final["completion_tokens"]
            assert rec.ttft_s == pytest.approx(final["ttft"], abs=1e-6)
            assert rec.reused_device_tokens + sum(rec.restored_tokens.values()) == rec.reused_tokens
            assert rec.reused_device_tokens >= 0
        c = replica.store.stats().counters
        assert c.swapped_in_host > 0                                     # the workload restored from the host
        assert sum(r.restored_tokens.get("host", 0) for r in recs) == c.swapped_in_host
        for r in recs:
            assert not hasattr(r, "prompt") and not hasattr(r, "prompt_token_ids") and not hasattr(r, "completion")
            assert "purple" not in r.getMessage()
        assert replica._turns == {} and replica._restored == {}          # nothing kept per session after its turns
    finally:
        replica.shutdown()


def test_log_prompts_adds_the_text(caplog, monkeypatch):
    monkeypatch.setenv("STATEFUL_HF_LOG_PROMPTS", "1")
    with caplog.at_level(logging.INFO, logger="stateful_hf.requests"):
        finals, replica = _run(turns=1)
    replica.shutdown()
    rec = next(r for r in caplog.records if r.name == "stateful_hf.requests")
    assert SECRET in rec.prompt and rec.completion_token_ids == finals[0]["token_ids"]


def test_json_format_is_one_object_per_line_with_the_fields():
    pytest.importorskip("pythonjsonlogger")
    rec = logging.LogRecord("stateful_hf.requests", logging.INFO, __file__, 1, "request end: %s", ("s1",), None)
    for k, v in {"event": "request_end", "session_id": "s1", "ttft_s": 0.012, "restored_tokens": {"host": 8}}.items():
        setattr(rec, k, v)
    line = formatter("json").format(rec)
    obj = json.loads(line)
    assert "\n" not in line
    assert obj["message"] == "request end: s1" and obj["level"] == "INFO" and obj["logger"] == "stateful_hf.requests"
    assert obj["session_id"] == "s1" and obj["restored_tokens"] == {"host": 8} and "timestamp" in obj
    with pytest.raises(ValueError):
        formatter("xml")


def test_configure_json_writes_json_lines(capsys, monkeypatch):
    pytest.importorskip("pythonjsonlogger")
    for k in ("STATEFUL_HF_LOG_FORMAT", "STATEFUL_HF_LOG_LEVEL", "STATEFUL_HF_LOG_PROMPTS"):
        monkeypatch.setenv(k, "")                 # registered: restored after the test
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure("json", "INFO")
        logging.getLogger("stateful_hf.moves").info("m", extra={"event": "tier_move", "tokens": 8})
        logging.getLogger("x").debug("hidden")
        assert env() == {"STATEFUL_HF_LOG_FORMAT": "json", "STATEFUL_HF_LOG_LEVEL": "INFO",
                         "STATEFUL_HF_LOG_PROMPTS": "0"}
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and lines[0]["event"] == "tier_move" and lines[0]["tokens"] == 8
