"""Drive one system through a scheduled workload with one thread per conversation (open loop) or per
user (closed loop). A turn is submitted when it is due: the conversation's start time for its first
turn, else the previous answer's end plus the turn's think time. Records every turn."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..harness.threads import hold_main_pool
from .workload import Conversation, Workload


@dataclass(slots=True)
class TurnRecord:
    conv_id: str
    turn: int
    prompt_len: int
    arrival: float             # when the turn was submitted (s since the run's start)
    first_token: float
    end: float
    tokens: list[int]
    reused: int


@dataclass(slots=True)
class RunResult:
    system: str
    records: list[TurnRecord]
    wall_s: float
    peak_bytes: dict[str, int]
    cpu_s: float               # CPU time of this process (all threads) during the run
    info: dict = field(default_factory=dict)


def run(system, wl: Workload, users: int = 0, on_turn=None, sample_every: float = 0.02) -> RunResult:
    """`users` > 0: closed loop with that many users taking conversations in order; else open loop."""
    records: list[TurnRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    peak: dict[str, int] = {}
    stop = threading.Event()

    def sample():
        while not stop.wait(sample_every):
            for tier, b in system.memory().items():
                peak[tier] = max(peak.get(tier, 0), b)

    def converse(c: Conversation, t0: float, at: float) -> None:
        history: list[int] = []
        due = at
        for k, turn in enumerate(c.turns):
            time.sleep(max(0.0, t0 + due - time.monotonic()))
            ids = history + list(turn.user_ids)
            sent = time.monotonic()
            r = system.run_turn(c.conv_id, ids, turn.output_len)
            if len(r.tokens) != turn.output_len:
                raise RuntimeError(f"{system.name}: {c.conv_id} turn {k} gave {len(r.tokens)} tokens, "
                                   f"expected {turn.output_len}")
            rec = TurnRecord(c.conv_id, k, len(ids), sent - t0, r.first_token_t - t0, r.end_t - t0, r.tokens,
                             r.reused)
            with lock:
                records.append(rec)
            if on_turn is not None:
                on_turn(rec)
            history = ids + r.tokens
            due = r.end_t - t0 + turn.think_s

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)

    def user(pending: deque, t0: float) -> None:
        while True:
            with lock:
                if not pending:
                    return
                c = pending.popleft()
            converse(c, t0, time.monotonic() - t0)

    hold_main_pool()                     # every system starts from the same thread state
    system.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, c0 = time.monotonic(), time.process_time()
    if users > 0:
        pending = deque(wl.conversations)
        threads = [threading.Thread(target=guarded, args=(user, pending, t0)) for _ in range(users)]
    else:
        threads = [threading.Thread(target=guarded, args=(converse, c, t0, c.start_s)) for c in wl.conversations]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    stop.set()
    sampler.join()
    for tier, b in system.memory().items():
        peak[tier] = max(peak.get(tier, 0), b)
    system.stop()
    if errors:
        raise errors[0]
    records.sort(key=lambda r: (r.conv_id, r.turn))
    return RunResult(system.name, records, wall, peak, cpu, system.info())
