"""The demo's chat logic, without Gradio: one engine, many chat sessions, per-turn numbers.

A chat is a list of {"role", "content"} messages kept by the UI (one per browser user). Every turn
sends the whole conversation, rendered by the chat template, to `engine.submit`: the store matches
it against the session's history, so a retry, an undo or an edit of an earlier message reuses the
longest prefix that is still valid and recomputes only the rest.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from stateful_hf import Engine, SamplingParams, SessionBusyError
from stateful_hf.cache.doors.demo import DemoStore

TIER_ORDER = ("device", "host", "hidden", "disk", "dropped")


@dataclass(frozen=True)
class TurnInfo:
    """One turn's numbers. `at_send_*`: where the history the turn reuses was when it was sent
    (tokens of the kept prefix per tier: device is served as is, host/disk are swapped in, hidden is
    rebuilt from hidden states, dropped is recomputed). The rest is the engine's own accounting."""

    turn: int
    ttft_ms: float | None
    latency_ms: float | None
    prompt_tokens: int
    output_tokens: int
    reused_tokens: int          # history served from stored KV (engine)
    recomputed_tokens: int      # history computed again (engine)
    truncated_tokens: int       # history cut: the prompt diverged from it (edit / retry / undo)
    computed_tokens: int        # prompt tokens the model ran (new and recomputed): reused + computed = prompt
    generated_tokens: int       # tokens the turn generated (the store's count; = output_tokens)
    at_send_device: int
    at_send_host: int
    at_send_hidden: int
    at_send_disk: int
    at_send_dropped: int
    hint_moved_tokens: int      # tokens the typing hint had moved up before the turn was sent
    finish_reason: str | None

    def as_dict(self) -> dict:
        return asdict(self)


class ChatBackend:
    def __init__(self, engine: Engine, max_new_tokens: int = 48):
        if engine.tokenizer is None or getattr(engine.tokenizer, "chat_template", None) is None:
            raise ValueError("the demo needs a tokenizer with a chat template")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.store: DemoStore = engine.store
        self.max_new_tokens = max_new_tokens
        self._hints: dict[str, object] = {}

    @staticmethod
    def new_session_id() -> str:
        return "chat-" + uuid.uuid4().hex[:12]

    def encode(self, messages: list[dict]) -> list[int]:
        return self.engine.encode(messages)

    def hint(self, session_id: str):
        """The user started typing: prefetch the session's KV (once per turn)."""
        if session_id in self._hints or session_id not in self.store:
            return None
        self._hints[session_id] = h = self.engine.hint(session_id)
        return h

    def forget(self, session_id: str | None) -> None:
        """Delete a chat's session from the store (its user left). A session mid-turn is left to the
        store's policy (it moves down and drops like any idle session)."""
        self._hints.pop(session_id, None)
        if session_id and session_id in self.store:
            with contextlib.suppress(SessionBusyError):
                self.store.delete(session_id)

    def _at_send(self, session_id: str, ids: list[int]) -> dict[str, int]:
        """Tokens of the prefix this turn keeps, per tier, now."""
        out = dict.fromkeys(TIER_ORDER, 0)
        if session_id not in self.store:
            return out
        keep = min(self.store.match_prefix(session_id, ids), len(ids) - 1)
        for tier, n in self.store.residency(session_id, upto=keep).items():
            out[tier] = out.get(tier, 0) + n
        return out

    def stream(self, session_id: str, messages: list[dict], turn: int, max_new_tokens: int | None = None,
               temperature: float = 0.0, seed: int | None = 0) -> Iterator[tuple[str, TurnInfo | None]]:
        """Yield (reply so far, None) while streaming, then (reply, TurnInfo). A failed turn raises its
        error (the engine's: a prompt too long for the context or the pool, ...). `seed` matters only
        with temperature > 0 (None: a fresh one, so a retry samples another reply)."""
        ids = self.encode(messages)
        at_send = self._at_send(session_id, ids)
        hint = self._hints.pop(session_id, None)
        moved = hint.moved_tokens if hint is not None else 0
        if hint is not None:
            hint.cancel()                       # whatever it has not moved, the turn's own step moves
        sampling = SamplingParams(max_new_tokens=max_new_tokens or self.max_new_tokens, temperature=temperature,
                                  seed=seed if temperature > 0 else None)
        handle = self.engine.submit(session_id, ids, sampling)
        text = ""
        for delta in handle.text_deltas():
            text += delta
            yield text, None
        out = handle.result(timeout=600)
        m = out.metrics
        last = self.store.stats(session_id).last_turn
        info = TurnInfo(
            turn=turn, ttft_ms=None if m.ttft is None else 1e3 * m.ttft,
            latency_ms=None if m.latency is None else 1e3 * m.latency, prompt_tokens=m.prompt_tokens,
            output_tokens=m.output_tokens, reused_tokens=m.reused_tokens, recomputed_tokens=m.recomputed_tokens,
            truncated_tokens=m.truncated_tokens, computed_tokens=prompt_computed(last),
            generated_tokens=last.generated_tokens,
            at_send_device=at_send["device"], at_send_host=at_send["host"], at_send_hidden=at_send.get("hidden", 0),
            at_send_disk=at_send["disk"], at_send_dropped=at_send["dropped"], hint_moved_tokens=moved,
            finish_reason=out.finish_reason)
        yield out.text or "", info

    # ---- rendering ------------------------------------------------------------------------------

    def tiers_html(self, session_id: str | None = None) -> str:
        """Bars of the store's tiers (tokens used of capacity), and this chat's share of each."""
        st = self.store.stats()
        mine = self.store.residency(session_id) if session_id and session_id in self.store else {}
        rows = []
        for tier in TIER_ORDER:
            used = getattr(st, f"{tier}_tokens", None)
            if used is None:
                continue
            cap = getattr(st, f"{tier}_capacity_tokens", None)
            if tier != "dropped" and not cap:
                continue                       # the store has no such tier
            full = max(cap or used, 1)
            share, own = 100 * used / full, 100 * min(mine.get(tier, 0), used) / full
            label = f"{used} / {cap} tokens" if cap else f"{used} tokens (ids only)"
            rows.append(
                f"<div class='shf-tier'><span class='shf-name'>{tier}</span>"
                f"<span class='shf-bar'><span class='shf-all' style='width:{share:.1f}%'></span>"
                f"<span class='shf-mine' style='width:{own:.1f}%'></span></span>"
                f"<span class='shf-num'>{label} (this chat: {mine.get(tier, 0)})</span></div>")
        c = st.counters
        needed = c.device_hits + c.swapped_in_host + c.swapped_in_disk + c.restored_hidden + c.recomputed
        hit = f"{st.hit_rate:.0%}" if needed else "— (no turn has needed stored history yet)"
        return (f"<div class='shf-tiers'><b>Session store</b> — {st.sessions} sessions, blocks of {st.block_size} "
                f"tokens{''.join(rows)}<div class='shf-traffic'>traffic: device hits {c.device_hits}, "
                f"swapped in host {c.swapped_in_host} / disk {c.swapped_in_disk}, swapped out "
                f"{c.swapped_out_host}, dropped {c.dropped}, recomputed {c.recomputed}; hit rate "
                f"<span id='shf-hit-rate'>{hit}</span></div></div>")

    @staticmethod
    def turns_html(turns: list[dict]) -> str:
        if not turns:
            return "<div class='shf-turns'><i>Per-turn numbers appear after the first reply.</i></div>"
        head = ("<tr><th>turn</th><th>TTFT<br>ms</th><th>prompt</th><th>reused</th><th>host/<br>disk</th>"
                "<th>hidden</th><th>re-<br>comp.</th><th>com-<br>puted</th><th>gen.</th><th>cut</th>"
                "<th>hint</th><th>end</th></tr>")
        body = "".join(
            f"<tr><td>{t['turn']}</td><td>{_ms(t['ttft_ms'])}</td><td>{t['prompt_tokens']}</td>"
            f"<td>{t['reused_tokens']}</td><td>{t['at_send_host']} / {t['at_send_disk']}</td>"
            f"<td>{t['at_send_hidden']}</td><td>{t['recomputed_tokens']}</td><td>{t['computed_tokens']}</td>"
            f"<td>{t['generated_tokens']}</td><td>{t['truncated_tokens']}</td><td>{t['hint_moved_tokens']}</td>"
            f"<td class='shf-end'>{t['finish_reason'] or '–'}</td></tr>" for t in turns)
        return (f"<div class='shf-scroll'><table class='shf-turns'>{head}{body}</table></div>"
                "<div class='shf-note'>Prompt = tokens the turn sent = reused + computed. Reused = history "
                "served from stored KV; host / disk / hidden = where that history was when the turn was sent "
                "(swapped in or rebuilt, not recomputed); recomp. = recomputed (part of computed); computed = "
                "prompt tokens the model ran (new, and recomputed history); gen. = tokens generated; cut = "
                "history dropped because the conversation changed there (an edit, retry or undo, or a reply "
                "whose text re-tokenizes differently); hint = tokens a typing hint moved up before the turn was "
                "sent; end = why the reply ended (stop: the model ended it; length: the max new tokens limit).</div>")


def prompt_computed(turn) -> int:
    """Prompt tokens a turn computed, from its `TurnStats`: `computed_tokens` counts every row the model
    ran, and the decode steps ran one row per generated token but the last (the first comes from the
    prompt's last row; the last is never fed), so the prompt's rows are computed - (generated - 1)."""
    return turn.computed_tokens - max(turn.generated_tokens - 1, 0)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"
