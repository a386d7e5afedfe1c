"""Crash the disk tier and count wrong turns: there must be none.

    python -m benchmarks.disk_faults loop [--seconds 300] [--dir D] [--seed 0]
    python -m benchmarks.disk_faults points [--script shared|behind]
    python -m benchmarks.disk_faults worker --dir D --seed S [--crash-at N] [--turns T] [--capacities 96 160]

`worker` (always a fresh interpreter: a process that has run torch is never forked) plays
conversations on four sessions of a tiny model through `model.generate` with a disk tier (each
opening with one system prompt, so they share its full chunks: prefix sharing, on disk too), with
random moves between tiers after each turn (filling the disk, so freed slots are reused within one
call), closing and reopening the store with the next `--capacities` every `--turns` turns
(relocation), for `--phases` store lifetimes.
Every turn is compared with stateless `generate`; it prints `turn ok` / `turn WRONG`, and `point N
NAME` at each durability point (`disk_index.durability_point`); with `--crash-at N` it SIGKILLs
itself at the N-th one. With `--script plain` / `--script shared` it plays a fixed scenario instead
(`scripted`, `scripted_shared`: sessions sharing a prompt on disk); `points` kills it at every one
of its durability points in turn and checks each reopened directory.

`loop` starts workers and SIGKILLs each at a random time (during opening, turns and moves; half of
them instead die at a random durability point, where the windows that matter are), then
reopens the directory in this process (`check_dir`): `check_integrity()`, and one turn per saved
session compared with stateless `generate`. Reports turns, wrong turns (0 expected), kills.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHUNK = 16
STORE = {"device_capacity": 256, "host_capacity": 64, "chunk_size": CHUNK, "policy": "lru"}
SESSIONS = ("s0", "s1", "s2", "s3")
SYSTEM_IDS = random.Random(5).choices(range(3, 300), k=64)     # a system prompt sessions open with
ROOT = Path(__file__).resolve().parent.parent


def _model():
    from stateful_hf.testing import tiny_llama
    return tiny_llama(seed=0)


def _store(model, directory, capacity, **kw):
    """The workers' store; `kw`: options over STORE (the fixed scripts pass disk_write="evict" or a write-behind
    delay they never reach: their durability points are numbered, so nothing may run in the background)."""
    import stateful_hf
    from stateful_hf.cache import CostProfile
    return stateful_hf.SessionStore(model, disk_dir=directory, disk_capacity=capacity,
                                    cost_profile=CostProfile(), **{**STORE, **kw})


EVICT = {"disk_write": "evict"}       # the scripts of the eviction path
BEHIND = {"write_behind_delay": 0.05}   # the random worker: write-behind runs between its turns and moves


def _greedy(model, ids: list[int], n: int, cache=None) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, **({"cache": cache} if cache is not None else {}))
    return out[0].tolist()


def exact_turn(model, store, sid: str, ids: list[int], n: int = 6) -> tuple[bool, list[int]]:
    """One turn through the store vs stateless generate: (equal, the stateless output)."""
    want = _greedy(model, ids, n)
    return _greedy(model, ids, n, cache=store.cache(sid)) == want, want


# ---- the worker (a fresh interpreter) ---------------------------------------------------------------

def _crash_hook(crash_at: int | None, kind: str | None = None) -> None:
    """Print each durability point; SIGKILL this process at the `crash_at`-th one (of `kind` only,
    if given: e.g. "data-flush", where a write into a reused slot is not committed yet)."""
    from stateful_hf.cache.disk import index as disk_index

    count = of_kind = 0

    def point(name: str) -> None:
        nonlocal count, of_kind
        count += 1
        of_kind += kind is None or name == kind
        print(f"point {count} {name}", flush=True)
        if of_kind == crash_at and (kind is None or name == kind):
            os.kill(os.getpid(), signal.SIGKILL)

    disk_index.durability_point = point


def worker(directory: str, seed: int, crash_at: int | None, turns: int, capacities: list[int], phases: int,
           crash_kind: str | None = None) -> None:
    from stateful_hf.cache import StoreError

    _crash_hook(crash_at, crash_kind)
    rng = random.Random(seed)
    model = _model()
    print("opening", flush=True)
    for capacity in itertools.islice(itertools.cycle(capacities), phases):
        store = _store(model, directory, capacity, **BEHIND)
        print("ready", flush=True)
        convs = {sid: list(store.session(sid).token_ids) if sid in store else [] for sid in SESSIONS}
        for _ in range(turns):
            sid = rng.choice(SESSIONS)
            if len(convs[sid]) > 120:                     # keep histories short: start over
                store.delete(sid)
                convs[sid] = []
            ids = (convs[sid] or SYSTEM_IDS[:40]) + [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]
            ok, convs[sid] = exact_turn(model, store, sid, ids)
            print("turn ok" if ok else f"turn WRONG {sid}", flush=True)
            if rng.random() < 0.6:                        # idle now: to disk (pushing others out, reusing slots)
                with contextlib.suppress(StoreError):
                    store.move(sid, [k for k, c in enumerate(store.session(sid).chunks)
                                     if c.state.value != "dropped"], "disk")
            other = rng.choice([s for s in SESSIONS if s in store])
            n = len(store.session(other).chunks)
            ks = rng.sample(range(n), rng.randint(0, n)) if n else []
            ks = [k for k in ks if store.session(other).chunks[k].state.value != "dropped"]
            with contextlib.suppress(StoreError, ValueError):
                store.move(other, ks, rng.choice(["disk", "disk", "host", "device", "dropped"]))
            store.check_integrity()
        store.close()
    print("done", flush=True)


def scripted(directory: str) -> None:
    """The crash test's fixed scenario (4 slots, then 3): s0 to disk; s1 to disk, which pushes two of
    s0's chunks out and reuses their slots; close; reopen smaller (relocation); turns; s0 to disk,
    pushing s1 out. Its durability points are listed by running it (`point N NAME` lines)."""
    from stateful_hf.cache import StoreError

    model, rng = _model(), random.Random(7)
    convs = {sid: [rng.randrange(3, 300) for _ in range(30)] for sid in ("s0", "s1")}

    def turn_then_disk(store, sid):
        ids = convs[sid] + ([rng.randrange(3, 300) for _ in range(5)] if sid in store else [])
        ok, convs[sid] = exact_turn(model, store, sid, ids)
        print("turn ok" if ok else f"turn WRONG {sid}", flush=True)
        with contextlib.suppress(StoreError):
            store.move(sid, [k for k, c in enumerate(store.session(sid).chunks) if c.state.value != "dropped"], "disk")
        store.check_integrity()

    store = _store(model, directory, 64, **EVICT)
    print("ready", flush=True)
    turn_then_disk(store, "s0")
    turn_then_disk(store, "s1")
    store.close()
    store = _store(model, directory, 48, **EVICT)
    print("ready", flush=True)
    turn_then_disk(store, "s1")
    turn_then_disk(store, "s0")
    store.close()
    print("done", flush=True)


def scripted_shared(directory: str) -> None:
    """The crash test's scenario with prefix sharing (6 slots, then 4): s0 and s1 open with one
    system prompt (3 shared chunks); s0 to disk (the shared chunks go once, for both); s1 continues
    (they come up in place) and goes to disk, pushing s0's own chunk out and reusing its slot; s2
    adopts the prefix from disk; s0 is deleted (the shared slots stay: others hold them); close;
    reopen smaller (relocation copies each shared slot once); turns of s1, s2 and a new s3 that
    adopts the prefix; s3 to disk; close."""
    from stateful_hf.cache import StoreError

    model, rng = _model(), random.Random(11)
    system = SYSTEM_IDS[:48]
    convs: dict[str, list[int]] = {}

    def turn(store, sid, n):
        ids = convs.get(sid, system) + [rng.randrange(3, 300) for _ in range(n)]
        ok, convs[sid] = exact_turn(model, store, sid, ids)
        print("turn ok" if ok else f"turn WRONG {sid}", flush=True)
        store.check_integrity()

    def to_disk(store, sid):
        with contextlib.suppress(StoreError):
            store.move(sid, [k for k, c in enumerate(store.session(sid).chunks) if c.state.value != "dropped"], "disk")
        store.check_integrity()
        shared = {id(c) for s in store.sessions for c in s.chunks
                  if c.entry is not None and len(c.entry.holders) > 1 and c.state.value == "disk"}
        print(f"shared on disk {len(shared)}", flush=True)

    store = _store(model, directory, 96, **EVICT)
    print("ready", flush=True)
    turn(store, "s0", 5)
    turn(store, "s1", 7)
    to_disk(store, "s0")
    turn(store, "s1", 5)
    to_disk(store, "s1")
    turn(store, "s2", 4)
    to_disk(store, "s2")
    store.delete("s0")
    store.check_integrity()
    store.close()
    store = _store(model, directory, 64, **EVICT)
    print("ready", flush=True)
    to_disk(store, "s1")
    turn(store, "s1", 3)
    turn(store, "s2", 3)
    turn(store, "s3", 6)
    to_disk(store, "s3")
    store.close()
    print("done", flush=True)


def scripted_behind(directory: str) -> None:
    """The crash test's scenario of write-behind and the flush (8 slots): s0's turn, its chunks written
    behind (the partial last one too); another turn (that copy goes stale: freed through limbo, the grown
    chunk written again); s1 likewise; s0 evicted to disk onto its copies (no write); s1's turn; close
    (the flush writes what is left); reopen; turns written behind; close. Write-behind runs in this
    thread (`write_due(now=True)`; the writer's own delay is never reached), so the points are numbered."""
    model, rng = _model(), random.Random(13)
    convs = {sid: [rng.randrange(3, 300) for _ in range(30)] for sid in ("s0", "s1")}

    def turn(store, sid, behind=True):
        ids = convs[sid] + ([rng.randrange(3, 300) for _ in range(5)] if sid in store else [])
        ok, convs[sid] = exact_turn(model, store, sid, ids)
        print("turn ok" if ok else f"turn WRONG {sid}", flush=True)
        if behind:
            store.writer.write_due(now=True)
            print(f"written behind {store.writer.stats.written}", flush=True)
        store.check_integrity()

    store = _store(model, directory, 128, write_behind_delay=3600)
    print("ready", flush=True)
    turn(store, "s0")
    turn(store, "s0")
    turn(store, "s1")
    store.move("s0", [k for k, c in enumerate(store.session("s0").chunks) if c.state.value != "dropped"], "disk")
    store.check_integrity()
    turn(store, "s1", behind=False)
    store.close()
    store = _store(model, directory, 128, write_behind_delay=3600)
    print("ready", flush=True)
    turn(store, "s0")
    turn(store, "s1")
    store.close()
    print("done", flush=True)


SCRIPTS = {"plain": scripted, "shared": scripted_shared, "behind": scripted_behind}


def start_worker(directory, seed: int = 0, crash_at: int | None = None, turns: int = 10_000,
                 capacities: tuple[int, ...] = (96, 160, 64), script: bool | str = False,
                 phases: int | None = None, crash_kind: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.disk_faults", "worker", "--dir", str(directory), "--seed", str(seed),
           "--turns", str(turns), "--capacities", *map(str, capacities),
           *(["--script", "plain" if script is True else script] if script else []),
           "--phases", str(phases or len(capacities))]
    if crash_at is not None:
        cmd += ["--crash-at", str(crash_at)] + (["--crash-kind", crash_kind] if crash_kind else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def run_worker(directory, seed: int = 0, crash_at: int | None = None, turns: int = 6,
               capacities: tuple[int, ...] = (96, 48), script: bool | str = False) -> tuple[int, list[str]]:
    """Run a worker to its end (or its crash): (return code, its output lines)."""
    return finish_worker(start_worker(directory, seed, crash_at, turns, capacities, script))


def finish_worker(p: subprocess.Popen) -> tuple[int, list[str]]:
    """Wait for a started worker (a fixed script's whole run may go beside a `crash_sweep`, whose workers
    leave a core idle while the parent checks a directory): (return code, its output lines)."""
    out, _ = p.communicate(timeout=600)
    return p.returncode, out.splitlines()


# ---- after a crash: reopen and check, in this process -------------------------------------------------

def check_dir(model, directory, capacity: int, seed: int = 0, prefix: list[int] | None = None) -> tuple[int, int]:
    """Reopen the tier, check integrity, and play one turn per saved session against stateless
    generate (then move it back to disk), then (with `prefix`) one of a new session opening with
    it (it adopts what the reopened index holds of it). Returns (turns, wrong turns)."""
    from stateful_hf.cache import StoreError

    rng = random.Random(seed)
    store = _store(model, directory, capacity)
    try:
        store.check_integrity()
        wrong = 0
        sids = store.session_ids()
        for sid in sids:
            ids = list(store.session(sid).token_ids) + [rng.randrange(3, 300) for _ in range(5)]
            ok, _ = exact_turn(model, store, sid, ids, n=4)
            wrong += not ok
            with contextlib.suppress(StoreError):         # back to disk: the next worker finds it there
                store.move(sid, [k for k, c in enumerate(store.session(sid).chunks) if c.state.value != "dropped"],
                           "disk")
        store.check_integrity()
        if prefix is not None:
            ok, _ = exact_turn(model, store, "check-new", prefix + [rng.randrange(3, 300) for _ in range(5)], n=4)
            wrong += not ok
            sids = [*sids, "check-new"]
            store.check_integrity()
        return len(sids), wrong
    finally:
        store.close()


def crash_sweep(model, points, directory, concurrency: int = 4, script: str = "plain"
                ) -> list[tuple[int, str, int, int]]:
    """Run the scripted worker (`script`: "plain", "shared" or "behind") once per point in `points`, SIGKILLed
    there (up to `concurrency` at a time), then reopen and check each directory (for "shared", a new
    session with the shared prompt too). Returns (point, its name, turns checked, wrong turns,
    counting the worker's own) per point."""
    out, todo, running = [], list(points), {}
    while todo or running:
        while todo and len(running) < concurrency:
            n = todo.pop(0)
            running[n] = start_worker(Path(directory) / f"crash{n}", crash_at=n, script=script)
        n = next(iter(running))
        p = running.pop(n)
        lines = p.communicate(timeout=600)[0].splitlines()
        if p.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the worker did not die at point {n}: exit {p.returncode}, {lines[-3:]}")
        turns, wrong = check_dir(model, Path(directory) / f"crash{n}", 64, seed=n,
                                 prefix=SYSTEM_IDS[:48] if script == "shared" else None)
        out.append((n, lines[-1].split()[2], turns, wrong + sum("WRONG" in line for line in lines)))
    return out


def kill_loop(seconds: float, directory=None, seed: int = 0, log=print) -> dict:
    """Workers killed at random times, each followed by a reopen and check. Returns the counts."""
    rng = random.Random(seed)
    model = _model()
    totals = {"kills": 0, "worker_turns": 0, "worker_wrong": 0, "checked_turns": 0, "checked_wrong": 0}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(directory or tmp)
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            caps = tuple(rng.choice([64, 128, 256]) for _ in range(3))
            # half the runs die at a random durability point, half of those at a data flush (the window
            # between writing into a slot, maybe one just freed, and the commit naming it)
            at_point = rng.random() < 0.5
            kind = rng.choice([None, "data-flush"]) if at_point else None
            p = start_worker(directory, seed * 1000 + i, crash_at=rng.randint(1, 40 if kind is None else 12)
                             if at_point else None, turns=rng.randint(2, 8), capacities=caps, phases=10_000,
                             crash_kind=kind)   # runs until killed
            lines = []
            wait_for = rng.choice(["opening", "ready", "ready"])
            for line in p.stdout:                      # kill after it starts (opening) or is open (ready)
                lines.append(line.strip())
                if line.strip() == wait_for:
                    break
            time.sleep(rng.uniform(0, 1.5))
            if not at_point:
                p.send_signal(signal.SIGKILL)
            rest, _ = p.communicate()
            lines += rest.splitlines()
            totals["kills"] += p.returncode == -signal.SIGKILL
            totals["worker_turns"] += sum(line.startswith("turn") for line in lines)
            totals["worker_wrong"] += sum(line.startswith("turn WRONG") for line in lines)
            turns, wrong = check_dir(model, directory, rng.choice([64, 128, 256]), seed=i)
            totals["checked_turns"] += turns
            totals["checked_wrong"] += wrong
            i += 1
            log(f"run {i}: killed={p.returncode == -signal.SIGKILL} after {sum(x.startswith('turn') for x in lines)} "
                f"turns, {sum(x.startswith('point') for x in lines)} durability points; reopened: {turns} sessions, "
                f"{wrong} wrong")
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--dir", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--crash-at", type=int)
    w.add_argument("--crash-kind", help="count only durability points of this name for --crash-at")
    w.add_argument("--turns", type=int, default=10_000)
    w.add_argument("--capacities", type=int, nargs="+", default=[96, 160, 64])
    w.add_argument("--phases", type=int, help="store lifetimes, cycling through the capacities (default: one each)")
    w.add_argument("--script", choices=list(SCRIPTS), help="a crash test's fixed scenario (`scripted`, "
                   "`scripted_shared`, `scripted_behind`)")
    pts = sub.add_parser("points", help="crash the scripted worker at every one of its durability points")
    pts.add_argument("--script", choices=list(SCRIPTS), default="plain")
    loop = sub.add_parser("loop")
    loop.add_argument("--seconds", type=float, default=300)
    loop.add_argument("--dir")
    loop.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "worker":
        if args.script:
            _crash_hook(args.crash_at)
            SCRIPTS[args.script](args.dir)
        else:
            worker(args.dir, args.seed, args.crash_at, args.turns, args.capacities, args.phases or len(args.capacities),
                   args.crash_kind)
        return
    t0 = time.monotonic()
    if args.cmd == "points":
        with tempfile.TemporaryDirectory() as tmp:
            code, lines = run_worker(Path(tmp) / "count", script=args.script)
            n = sum(line.startswith("point") for line in lines)
            results = crash_sweep(_model(), range(1, n + 1), tmp, script=args.script)
        for point, name, turns, wrong in results:
            print(f"crash at point {point:3d} {name:20s}: {turns} sessions reopened, {wrong} wrong")
        print(f"{time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}")
        sys.exit(1 if any(r[3] for r in results) else 0)
    totals = kill_loop(args.seconds, args.dir, args.seed)
    print(f"{time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}: {totals}")
    if totals["worker_wrong"] or totals["checked_wrong"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
