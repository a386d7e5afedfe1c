"""The server's logs: text or JSON lines (`--log-format json`, python-json-logger), and the records
an operator follows a session by. Each record's fields are attributes of its LogRecord (keys of the
JSON object); the text format shows the message only.

- logger `stateful_hf.requests`, event "request_end": one per finished turn (`request_end`).
- logger `stateful_hf.moves`, event "tier_move": one per batch of chunks moved between tiers
  (`stateful_hf/cache/movement/moves.py`).

Prompt and completion text (and ids) are logged only with `--log-prompts`. The settings travel to
Ray replicas (other processes) in environment variables (`env`, `configure_from_env`).
"""

from __future__ import annotations

import logging
import os

REQUESTS = logging.getLogger("stateful_hf.requests")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_FORMAT, _LEVEL, _PROMPTS = "STATEFUL_HF_LOG_FORMAT", "STATEFUL_HF_LOG_LEVEL", "STATEFUL_HF_LOG_PROMPTS"


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "text":
        return logging.Formatter(TEXT_FORMAT)
    if fmt == "json":
        try:
            from pythonjsonlogger.core import RESERVED_ATTRS
            from pythonjsonlogger.json import JsonFormatter
        except ImportError:
            raise ImportError("--log-format json needs python-json-logger (pip install 'stateful-hf[serve]')") from None
        return JsonFormatter("%(levelname)s %(name)s %(message)s", timestamp=True,
                             rename_fields={"levelname": "level", "name": "logger"},
                             reserved_attrs=[*RESERVED_ATTRS, "color_message"])   # uvicorn's ANSI copy of message
    raise ValueError(f"unknown log format {fmt!r}; choose from {FORMATS}")


def configure(fmt: str = "text", level: str | int = "INFO", log_prompts: bool = False) -> None:
    """This process's root logging (stderr), replacing its handlers; remembered in the environment."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    os.environ.update({_FORMAT: fmt, _LEVEL: logging.getLevelName(logging.getLogger().level),
                       _PROMPTS: "1" if log_prompts else "0"})


def env() -> dict[str, str]:
    """The settings `configure` made, for processes started elsewhere (Ray's runtime_env)."""
    return {k: os.environ[k] for k in (_FORMAT, _LEVEL, _PROMPTS) if k in os.environ}


def configure_from_env() -> None:
    if _FORMAT in os.environ:
        configure(os.environ[_FORMAT], os.environ.get(_LEVEL, "INFO"), os.environ.get(_PROMPTS) == "1")


def log_prompts() -> bool:
    return os.environ.get(_PROMPTS) == "1"


def _secs(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def request_end(out, replica: str, session_id: str | None, restored: dict[str, int],
                prompt: list[int] | None = None, tokenizer=None) -> None:
    """One line for a finished turn (a RequestOutput). `session_id` None: a throwaway session.
    `restored`: tokens this turn's steps brought up to the device, by source tier (the rest of
    `reused_tokens` was on the device already)."""
    if not REQUESTS.isEnabledFor(logging.INFO):
        return
    m = out.metrics
    fields = {"event": "request_end", "session_id": session_id, "request_id": out.request_id, "replica": replica,
              "finish_reason": out.finish_reason, "prompt_tokens": m.prompt_tokens, "reused_tokens": m.reused_tokens,
              "reused_device_tokens": m.reused_tokens - sum(restored.values()), "restored_tokens": restored,
              "recomputed_tokens": m.recomputed_tokens, "truncated_tokens": m.truncated_tokens,
              "generated_tokens": m.output_tokens, "suspensions": m.suspensions, "ttft_s": _secs(m.ttft),
              "tpot_s": _secs(m.tpot), "latency_s": _secs(m.latency), "queue_s": _secs(m.queue_time)}
    if out.error is not None:
        fields["error"] = f"{type(out.error).__name__}: {out.error}"
    if log_prompts():
        fields["prompt_token_ids"] = list(prompt or [])
        fields["completion_token_ids"] = list(out.token_ids)
        if tokenizer is not None and prompt:
            fields["prompt"] = tokenizer.decode(prompt)
        fields["completion"] = out.text
    ttft = "-" if m.ttft is None else f"{m.ttft * 1e3:.1f} ms"
    REQUESTS.info("request end: session %s on %s, %s: %d prompt tokens, %d reused (%s brought up), %d recomputed, "
                  "%d generated, TTFT %s", session_id, replica, out.finish_reason, m.prompt_tokens, m.reused_tokens,
                  restored or "none", m.recomputed_tokens, m.output_tokens, ttft, extra=fields)
