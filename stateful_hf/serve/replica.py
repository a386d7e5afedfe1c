"""`Replica`: one engine behind the server (the single-machine server has one; a cluster N).

Streams a turn as plain-dict events (so they cross process boundaries unchanged):
`{"type": "delta", "text", "token_ids"}`... (with `"logprobs"` when the sampling asks: those of the
tokens whose text the delta's text completes, so the deltas' logprobs concatenate to the final ones),
then `{"type": "done", ...final...}` or `{"type": "error", "error": APIError.to_dict()}`. Also hints,
session export/import (migration), load and metrics. Everything is async-friendly: no request parks a
thread; one watcher thread (`stream_hub.py`) wakes after each engine step and forwards progress to the
waiting coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cache.doors.server import CapacityError, ServerStore, SessionBusyError, StoreError, split_key
from ..engine import Engine, SamplingParams
from . import logs
from .error_boundary import logged
from .metrics import ReplicaMetrics
from .migrate import SessionExport, export_session, import_session
from .protocol import APIError
from .session_queue import SessionQueue
from .stream_hub import StreamHub

if TYPE_CHECKING:
    from ..cache.doors.server import FlushReport

log = logging.getLogger("stateful_hf.serve")
CANCEL_TIMEOUT = 5.0           # seconds the shutdown waits for the cancelled turns to end (the loop to stop)


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What a replica's shutdown did, in its order: turns cancelled (in flight at the signal) and the loop stopped
    (`cancel_s`), the flush (`flush`: the store's FlushReport, None without a disk tier; `flush_s`), the store
    closed (`close_s`)."""

    cancelled: int
    cancel_s: float
    flush: FlushReport | None
    flush_s: float
    close_s: float


def api_error(e: BaseException) -> APIError:
    """An engine error as the HTTP error a client gets."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SessionBusyError):
        return APIError(409, f"session {split_key(e.session_id)[1]!r} has a turn in flight; retry when it has "
                        "finished", param="session_id", code="session_busy", retry_after=1)
    if isinstance(e, ValueError) and getattr(e, "param", None):   # a constraint's GrammarError names its field
        return APIError(400, str(e), param=e.param, code=getattr(e, "code", None) or "invalid_value")
    if isinstance(e, CapacityError):              # the prompt and max_tokens do not fit the pools
        return APIError(400, str(e), param="prompt", code="capacity_exceeded")
    if isinstance(e, (ValueError, TypeError)):    # a bad prompt, or a turn under another cache_salt
        return APIError(400, str(e), param="cache_salt" if "cache_salt" in str(e) else "prompt", code="invalid_prompt")
    return logged(e, "a turn")         # a generic 500 with a request id; the exception is logged


def wire_logprobs(entries) -> list:
    """`sampling.TokenLogprob`s as plain lists (events cross process boundaries): [[token, logprob,
    [[alternative, logprob], ...]], ...]."""
    return [[t, lp, [list(a) for a in alts]] for t, lp, alts in entries]


def covered(ends, start: int, chars: int, n: int) -> int:
    """One past the last of the `n` tokens, from `start` on, whose text ends within the first `chars`
    chars streamed (`ends[i]`: where token i's text ends; tokens past `ends`, as without a tokenizer,
    wait for the end). Tokens are taken in order: one whose text is held back (a stop string forming, an
    incomplete UTF-8 sequence) holds back those after it, so each token is sent once, with its text."""
    k = start
    while k < min(n, len(ends)) and ends[k] <= chars:
        k += 1
    return k


def freeze_heap() -> int:
    """Collect, then move every object alive into the collector's permanent generation (`gc.freeze`), as vLLM and
    SGLang do after their warm-up: what startup made (torch, transformers, the model, a restart's 10^4 sessions:
    ~5x10^5 objects) is never walked again, so a full collection while serving walks only what came after (one
    walked them all in ~0.3-0.4 s on this 2-core host, holding the GIL: every step and request waited). Returns
    the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Replica:
    """An engine (started here) plus what the server needs around it. `name` labels its metrics.
    Turns of one session queue in arrival order, each waiting at most `session_wait_timeout` s.
    `shutdown_flush_timeout`: the seconds `shutdown` gives the disk tier's flush (0: none; what write-behind
    has not written is recomputed after a restart)."""

    def __init__(self, engine: Engine, name: str = "0", session_wait_timeout: float = 30.0,
                 shutdown_flush_timeout: float = 4.0):
        self.engine, self.name = engine.start(), name
        self.store: ServerStore = engine.store
        self.store.prefetch_shared()   # a restart's shared prefixes up from disk, before /health (docs/durability.md)
        engine.warm_up()          # the loop's first step's set-up, before /health
        self.shutdown_flush_timeout = shutdown_flush_timeout
        self.cancelled = 0                             # turns cancelled by `cancel_turns` (the shutdown's)
        self.metrics = ReplicaMetrics(self.store, engine)
        # tokens brought up to the device by steps, per session with a turn here, by source tier (for logs)
        self._restored: dict[str, dict[str, int]] = {}
        self._turns: dict[str, int] = {}               # ... and how many of its turns are being tracked
        self._track_lock = threading.Lock()             # both: event loop and engine thread
        self.store.moves.subscribe(self._moved)
        self.hub = StreamHub(engine)
        self.inflight = 0
        self.turns = SessionQueue(session_wait_timeout)
        self._gates: dict[str, threading.Event] = {}   # sessions being imported: turns wait
        self._fork_parents: dict[str, str] = {}        # fork group -> the store key of its first turn in flight here

    # ---- turns ----------------------------------------------------------------------------------

    async def stream(self, session_id: str | None, prompt: list[int], sampling: SamplingParams | dict, *,
                     cache_salt: str | None = None, tenant: str | None = None,
                     fork: str | None = None, continues: str | None = None) -> AsyncIterator[dict]:
        """One turn. `session_id` None: a throwaway session of `tenant`, deleted by the engine when the
        turn ends (`Engine.throwaway_session`). `cache_salt`: scopes prefix sharing (`Engine.submit`).
        `fork`: a fork group (choices.py: the `n` choices of one prompt). The group's first turn here is
        its parent while it runs; a later turn of the group whose session is new starts as a fork of the
        parent's session (`KVStore.fork`: its full chunks shared, its partial last chunk copied).
        `continues`: a held choice's fork session (choices.py) whose history and KV the session takes
        first (`_continue`), with the session's turn slot held."""
        if isinstance(sampling, dict):
            sampling = SamplingParams(**sampling)
        if sampling.constraint is not None:     # compile off the event loop, before the turn takes anything
            error = await self._compile(sampling)
            if error is not None:
                yield {"type": "error", "error": api_error(error).to_dict()}
                return
        ephemeral = session_id is None
        sid = self.engine.throwaway_session(tenant) if ephemeral else session_id
        gate = self._gates.get(sid)
        if gate is not None:
            await asyncio.to_thread(gate.wait, 60)
        if not ephemeral:
            try:
                await self.turns.acquire(sid)          # FIFO per session; 409 after the wait timeout
            except APIError as e:
                yield {"type": "error", "error": e.to_dict()}
                return
        self.inflight += 1
        with self._track_lock:
            self._turns[sid] = self._turns.get(sid, 0) + 1
            baseline = dict(self._restored.setdefault(sid, {}))
        account = lambda out: self._account(out, sid, None if ephemeral else sid, baseline, prompt)
        parent = self._fork_parents.setdefault(fork, sid) if fork is not None else sid
        forked = False
        try:                                   # the awaits inside: a client gone meanwhile frees the slot
            if continues is not None and not ephemeral:
                await self._continue(continues, sid, prompt)
            forked = parent != sid and await self._fork(parent, sid, prompt)
            handle, done = self.engine.submit(sid, prompt, sampling, cache_salt=cache_salt), False
        except BaseException:
            self.inflight -= 1
            self._untrack(sid)
            self._unfork(fork, sid)
            if forked and ephemeral:            # no turn will end to delete it
                with contextlib.suppress(Exception):
                    self.store.delete(sid)
            if not ephemeral:
                self.turns.release(sid)
            raise
        st = self.hub.open(handle)
        sent_text, sent_tok, sent_lp = 0, 0, 0
        try:
            while True:
                await st.event.wait()
                st.event.clear()
                p = st.latest                  # a request.Progress
                tokens, text, out, lps = p.tokens, p.text, p.output, p.logprobs
                if out is not None:
                    if out.error is not None:
                        done = True
                        account(out)
                        yield {"type": "error", "error": api_error(out.error).to_dict()}
                        return
                    text = out.text or ""
                if len(text) > sent_text or len(tokens) > sent_tok or (out is not None and len(lps) > sent_lp):
                    ev = {"type": "delta", "text": text[sent_text:], "token_ids": list(tokens[sent_tok:])}
                    if sampling.logprobs is not None:      # the tokens whose text this delta completes
                        upto = len(lps) if out is not None else covered(p.ends, sent_lp, len(text), len(lps)) \
                            if len(text) > sent_text else sent_lp
                        ev["logprobs"], sent_lp = wire_logprobs(lps[sent_lp:upto]), upto
                    yield ev
                    sent_text, sent_tok = len(text), len(tokens)
                if out is not None:
                    done = True
                    account(out)
                    yield self._final(out)
                    return
        finally:
            self._unfork(fork, sid)
            self.hub.close(st)
            self.inflight -= 1
            if not done:
                handle.cancel()               # the client went away: account the turn when it ends
            if not done:
                self._when_done(handle, lambda out: self._after(out, sid, ephemeral, account))
            elif not ephemeral:               # the engine has ended the request: the next turn may go
                self.turns.release(sid)

    async def _fork(self, parent: str, sid: str, prompt: list[int]) -> bool:
        """Session `sid` (new) as a fork of `parent` up to their common prefix with `prompt` (in a worker
        thread: a device copy). False where it cannot be (the parent gone, `sid` not new, sharing off): the
        turn then adopts the prompt's indexed chunks and computes the rest, as without a fork."""
        return sid not in self.store and await self._store_fork(parent, sid, prompt, replace=False)

    async def _continue(self, chosen: str, sid: str, prompt: list[int]) -> bool:
        """Session `sid` (its turn slot held) becomes a fork of `chosen` (a held choice: its history up to
        the common prefix with `prompt`, full chunks shared, partial last chunk copied), replacing what
        `sid` held in one store operation (`KVStore.fork(replace=True)`). False where it cannot be (the
        choice gone or busy here, sharing off): `sid` stays as it is and the turn recomputes from where
        the prompt leaves its history; `chosen` is left to the caller to free either way."""
        return not self.turns.busy(chosen) and await self._store_fork(chosen, sid, prompt, replace=True)

    async def _store_fork(self, source: str, sid: str, prompt: list[int], replace: bool) -> bool:
        """`KVStore.fork(source, sid, prompt, replace)` in a worker thread (a device copy); False, logged, where the
        store refuses (`source` gone or busy, `sid` taken without `replace`, sharing off, another tenant)."""
        try:
            await asyncio.to_thread(self.store.fork, source, sid, prompt, replace=replace)
        except (StoreError, KeyError, ValueError) as e:   # UnknownSessionError: KeyError; SessionBusyError: StoreError
            log.debug("no fork of %s as %s: %s", source, sid, e)
            return False
        return True

    def _unfork(self, fork: str | None, sid: str) -> None:
        """The turn of `sid` ends: if it was its fork group's parent here, later turns of the group fork no more."""
        if fork is not None and self._fork_parents.get(fork) == sid:
            del self._fork_parents[fork]

    async def _compile(self, sampling: SamplingParams) -> Exception | None:
        """Compile a constrained turn's grammar into the engine's cache in a worker thread (in a cluster
        the app compiled it in another process; `Engine.submit` then finds it). Returns why it cannot
        be compiled (a `GrammarError`), or None."""
        from ..engine.grammar import COMPILERS, GrammarError
        timeout = self.engine.config.grammar_compile_timeout
        try:
            await asyncio.to_thread(COMPILERS.compile, self.engine.tokenizer, sampling.constraint, timeout)
        except GrammarError as e:
            return e
        return None

    def _final(self, out) -> dict:
        m = out.metrics
        reason = out.finish_reason if out.finish_reason in ("stop", "length") else out.finish_reason
        return {"type": "done", "text": out.text or "", "token_ids": list(out.token_ids), "finish_reason": reason,
                "prompt_tokens": m.prompt_tokens, "completion_tokens": m.output_tokens,
                "reused_tokens": m.reused_tokens, "recomputed_tokens": m.recomputed_tokens,
                "ttft": m.ttft, "tpot": m.tpot, "replica": self.name,
                "logprobs": None if out.logprobs is None else wire_logprobs(out.logprobs)}

    def _moved(self, batch) -> None:
        """A store move batch (engine thread, store lock held): metrics, and per-turn restored tokens."""
        self.metrics.moved(batch)
        if batch.dst == "device" and batch.reason == "step":
            with self._track_lock:
                for sid, n in batch.sessions:
                    tiers = self._restored.get(sid)
                    if tiers is not None:
                        tiers[batch.src] = tiers.get(batch.src, 0) + n

    def _account(self, out, sid: str, logged_sid: str | None, baseline: dict[str, int], prompt: list[int]) -> None:
        """A turn ended: metrics and its log line. The tokens restored per tier are those recorded for
        the session since the turn was submitted (none for a turn that failed: one refused as busy
        would see another turn's)."""
        self.metrics.finished(out)
        with self._track_lock:
            now = self._restored.get(sid, {})
            restored = {} if out.error is not None else {t: n - baseline.get(t, 0) for t, n in now.items()
                                                         if n > baseline.get(t, 0)}
        self._untrack(sid)
        logs.request_end(out, self.name, logged_sid, restored, prompt, self.engine.tokenizer)

    def _untrack(self, sid: str) -> None:
        with self._track_lock:
            self._turns[sid] -= 1
            if not self._turns[sid]:
                del self._turns[sid]
                self._restored.pop(sid, None)

    def _after(self, out, sid: str, ephemeral: bool, account) -> None:
        """A turn whose client went away has ended: account it, let the session's next turn go (a
        throwaway session is deleted by the engine)."""
        account(out)
        if not ephemeral:
            self.turns.release(sid)

    def _when_done(self, handle, fn) -> None:
        """Call fn(output) when the request has ended (now, if it has)."""
        self.engine.requests.when_finished(handle, fn)

    # ---- hints and migration --------------------------------------------------------------------

    def hint(self, session_id: str, expected_arrival: float | None = None, priority: int | None = None) -> dict:
        h = self.engine.hint(session_id, expected_arrival, priority)
        self.metrics.inc("hints_total")

        def account():
            if h.wait(120):
                self.metrics.inc("hint_prefetched_tokens_total", h.moved_tokens)
                self.metrics.inc("hints_finished", outcome=(h.stopped or "unknown").split(":")[0])
        threading.Thread(target=account, daemon=True).start()
        return {"session_id": session_id, "replica": self.name, "accepted": True}

    def has_session(self, session_id: str) -> bool:
        return session_id in self.store

    def session_tokens(self, session_id: str) -> int:
        return self.store.num_tokens(session_id)

    def tenant_usage(self, tenant: str, keys: list[str]) -> dict:
        """The tenant's sessions and tokens here, and the history tokens of those of `keys` held here."""
        u = self.store.tenant_usage().get(tenant)
        present = {k: self.store.num_tokens(k) for k in keys if k in self.store}
        return {"sessions": u.sessions if u else 0, "history_tokens": u.history_tokens if u else 0,
                "stored_tokens": u.stored_tokens if u else 0, "present": present}

    def session_info(self, session_id: str) -> dict | None:
        """The session's tokens per tier and last activity (None if this replica does not have it)."""
        try:        # each store call is atomic; a turn running meanwhile shows as busy
            s = self.store.stats(session_id)
            tiers = self.store.residency(session_id)
        except KeyError:                # not here, or deleted meanwhile (UnknownSessionError is a KeyError)
            return None
        now = self.store.clock()
        idle = max(now - s.last_active, 0.0)
        return {"id": split_key(session_id)[1], "object": "session", "replica": self.name, "tokens": s.num_tokens,
                "tiers": tiers, "busy": s.busy or self.turns.busy(session_id),
                "queued_turns": self.turns.waiting(session_id), "idle_seconds": idle,
                "last_active_at": time.time() - idle, "retained_seconds": max(s.expected_at - now, 0.0)}

    def delete_session(self, session_id: str) -> dict:
        """`session_id` is the store key (tenant-qualified); replies name the caller's own id.
        Free the session's KV in every tier and forget its history. A session with a turn running or
        queued is not deleted: 409 (retry after the turn); an unknown one: 404. Call it on the replica's
        event loop (where turns take their queue slot), so no turn slips in between check and delete."""
        shown = split_key(session_id)[1]
        if self.turns.busy(session_id) or session_id in self._gates:
            raise APIError(409, f"session {shown!r} has a turn in flight or queued; delete it when the "
                           "turn has finished", param="session_id", code="session_busy", retry_after=1)
        if session_id not in self.store:
            raise APIError(404, f"no session {shown!r}", param="session_id", code="session_not_found",
                           type="not_found_error")
        tokens = self.store.num_tokens(session_id)
        try:
            self.store.delete(session_id)
        except SessionBusyError:        # a hint (or a migration) holds it this moment
            raise APIError(409, f"session {shown!r} is being moved between tiers; retry", param="session_id",
                           code="session_busy", retry_after=1) from None
        except KeyError:                # gone meanwhile (UnknownSessionError is a KeyError)
            raise APIError(404, f"no session {shown!r}", param="session_id", code="session_not_found",
                           type="not_found_error") from None
        return {"id": shown, "object": "session.deleted", "deleted": True, "freed_tokens": tokens}

    def export_session(self, session_id: str) -> SessionExport | None:
        """The session's history and stored KV (None if this replica does not have it)."""
        if session_id not in self.store:
            return None
        exp = export_session(self.store, session_id)
        self.metrics.inc("migrations_out_total")
        return exp

    def import_session(self, exp: SessionExport | None) -> dict:
        """Take over a session exported by another replica; its KV lands on the device. Turns of the
        session submitted here meanwhile wait for the import."""
        if exp is None:
            return {"imported_tokens": 0, "seconds": 0.0}
        gate = self._gates[exp.session_id] = threading.Event()
        t0 = time.monotonic()
        try:
            n = import_session(self.store, exp)
        finally:
            del self._gates[exp.session_id]
            gate.set()
        dt = time.monotonic() - t0
        self.metrics.inc("migrations_in_total")
        self.metrics.inc("migrated_tokens_total", n)
        self.metrics.inc("migration_seconds_total", dt)
        return {"imported_tokens": n, "seconds": dt, "residency": self.store.residency(exp.session_id)}

    def release_session(self, session_id: str) -> bool:
        """Forget a session that moved to another replica (its KV was imported there)."""
        try:
            self.store.delete(session_id)
            return True
        except Exception:   # noqa: BLE001 - busy (a turn arrived here after all) or already gone
            return False

    # ---- state ----------------------------------------------------------------------------------

    def load(self) -> int:
        return self.inflight

    def snapshot(self) -> list[dict]:
        """This replica's metric families as plain data (serve/exposition.py)."""
        return self.metrics.snapshot()

    def health(self) -> dict:
        return {"replica": self.name, "engine_running": self.engine.running, "inflight": self.inflight}

    def cancel_turns(self) -> int:
        """Cancel every turn in flight (their streams end with finish_reason "cancelled" at the next step);
        the number cancelled, also added to `cancelled`. Any thread (the server calls it as its exit signal
        arrives, before the connections close)."""
        stats = self.engine.stats()
        self.engine.requests.cancel_all()
        self.cancelled += stats.running + stats.waiting
        return stats.running + stats.waiting

    def shutdown(self) -> ShutdownReport:
        """Cancel the turns in flight and stop the engine (at most `CANCEL_TIMEOUT` s), flush the disk tier within
        `shutdown_flush_timeout` s (what it leaves is said in one log line, `DiskWriter.flush`), close the store
        (write-behind stopped, the index committed). One log line says each phase's time."""
        t0 = time.monotonic()
        self.cancel_turns()
        cancelled = self.cancelled
        self.engine.stop(cancel=True, timeout=CANCEL_TIMEOUT, flush=None)
        t1 = time.monotonic()
        report = self.store.flush(self.shutdown_flush_timeout)
        t2 = time.monotonic()
        self.store.close(flush=False)                   # write-behind stopped: nothing is written after the flush
        self.hub.shutdown()
        done = ShutdownReport(cancelled, t1 - t0, report, t2 - t1, time.monotonic() - t2)
        wrote = "no disk tier" if report is None else (
            f"flush wrote {report.chunks_written} chunks ({report.tokens_written} tokens), left {report.chunks_left} "
            f"({report.tokens_left} tokens)")
        log.info("replica %s shut down: %d turns cancelled and the engine stopped in %.3f s; %s in %.3f s (budget "
                 "%.1f s); store closed in %.3f s", self.name, cancelled, done.cancel_s, wrote, done.flush_s,
                 self.shutdown_flush_timeout, done.close_s,
                 extra={"event": "replica_shutdown", "replica": self.name, "cancelled": cancelled,
                        "cancel_s": round(done.cancel_s, 6), "flush_s": round(done.flush_s, 6),
                        "close_s": round(done.close_s, 6), "flush_budget_s": self.shutdown_flush_timeout,
                        "chunks_written": None if report is None else report.chunks_written,
                        "tokens_written": None if report is None else report.tokens_written,
                        "chunks_left": None if report is None else report.chunks_left,
                        "tokens_left": None if report is None else report.tokens_left})
        return done
