"""The restart drill (issues 52 and 53): N sessions served by the real server subprocess
(`python -m stateful_hf.serve MODEL --disk-dir DIR`), killed and restarted; what a restart keeps, and what the
shutdown costs.

    python -m benchmarks.restart_drill [--model smollm2-135m-instruct] [--sessions 16] [--turns 3] [--kills 1]
        [--streams 4] [--stream-tokens 1900] [--answer 16] [--out benchmarks/results/restart_drill.json]

Rounds, on one --disk-dir:
1. warm-up: every session's first `--turns` turns, in bursts (all sessions at once, `--concurrency` in flight);
   the server-side TTFT of each session's last returning turn is the reference ("before").
2. each of `--kills` rounds: the sessions keep taking turns (a random pause of 0-`--think` s before each turn of a
   session, so at the kill some are idle since the warm-up, some in flight, some just done) and the server is
   SIGKILLed at a random moment of that traffic (`--kill-after`); each session's last completion time
   is recorded against the kill's. Restart; every session sends its next turn (its last completed conversation
   plus a user message). A session is kept whole when that turn reuses every token the server held after its
   last completed turn (prompt + answer - 1: the answer's last token has no KV yet). Target: every session whose
   last turn completed more than `--write-behind-delay` plus one queue drain (`--drain`, 1 s) before the kill,
   with no turn in flight, is kept whole.
3. SIGTERM: `--streams` long streams (`--stream-tokens` each, ignore_eos) and one client that disconnects after
   a few chunks run when SIGTERM comes; the streams' end (cancel) and the process's exit are timed, and the
   server's shutdown lines split the time into drain (cancel + connections closed), the flush and the rest.
   Restart; time from the process's start to its first served returning turn; `--probes` sessions' next turns
   one at a time (the process's first, then the others), each TTFT against the same session's previous
   returning turn, also taken alone before the SIGTERM (before); then every session's next turn: sessions kept
   and tokens reused / held (target 100 % and >= 99 %). One turn's TTFT swings 2-3x on a 2-core host with the
   server's OpenMP team of 2 (docs/durability.md): the medians over the probes are the comparison.
Wrong answers: every returning turn after a restart is compared, token for token, with stateless greedy
`generate` (transformers, float32) on the same ids in this process, after the servers are down (`--verify`
limits the sessions that send a turn after the SIGTERM restart: a random sample, for `--sessions 10000`).
The cheap mode for many sessions: `--model tiny-random --turns 1 --answer 1 --kills 0 --streams 0 --verify 200
--device-tokens 65536`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the sea", "volcanoes", "bread", "chess", "rivers", "bees", "glass", "clocks", "maps", "tea", "snow",
          "bridges", "owls", "paper", "salt", "the moon"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Session:
    """One conversation as the client holds it: the ids of its last completed turn's prompt + answer."""

    sid: str
    ids: list[int]                       # the conversation the server holds (prompt + answer of the last turn)
    held: int = 0                        # KV tokens the server holds after the last completed turn
    done_at: float = 0.0                 # monotonic time the last turn completed (the client got the answer)
    in_flight: bool = False
    turns: int = 0
    ttft_before: float | None = None     # server-side TTFT of the last returning turn before a restart
    lock: threading.Lock = field(default_factory=threading.Lock)


class Server:
    """One server subprocess; JSON logs into `log`."""

    def __init__(self, args, disk: Path, log: Path):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}
        env.pop("STATEFUL_HF_API_KEY", None)
        cmd = [sys.executable, "-m", "stateful_hf.serve", args.model, "--dtype", "float32", "--port", str(self.port),
               "--disk-dir", str(disk), "--disk-capacity", str(args.disk_tokens),
               "--device-capacity", str(args.device_tokens), "--write-behind-delay", str(args.write_behind_delay),
               "--shutdown-flush-timeout", str(args.shutdown_flush_timeout), "--log-format", "json",
               "--max-num-seqs", str(args.max_num_seqs)]
        self.started = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
            try:
                if self.client.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.ready = time.monotonic()

    def records(self, event: str) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("event") == event:
                    out.append(r)
        return out

    def kill(self) -> float:
        self.proc.kill()
        t = time.monotonic()
        self.proc.wait()
        self.client.close()
        return t

    def term(self, timeout: float = 120) -> tuple[float, float]:
        """SIGTERM; (signal time, exit time)."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        e = time.monotonic()
        self.client.close()
        return t, e


def load(name: str):
    import torch

    from stateful_hf.models import TINY_MODELS, load, load_tiny
    if name in TINY_MODELS:
        return load_tiny(name)
    return load(name, dtype=torch.float32)


def first_prompt(tok, i: int, words: int, system: str | None = None) -> list[int]:
    """Session i's first prompt: a user message of about `words` words (after a `system` message every
    session shares, when given), in the tokenizer's chat template when it has one."""
    topic = TOPICS[i % len(TOPICS)]
    text = f"Session {i}. " + " ".join(["Tell me one short fact about", topic] * max(1, words // 6))
    if getattr(tok, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        out = tok.apply_chat_template(messages + [{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return list(tok(text)["input_ids"])


def follow_up(tok, i: int, turn: int) -> list[int]:
    text = f"And another one about {TOPICS[(i + turn) % len(TOPICS)]}, please (turn {turn})."
    if "<|im_start|>" in tok.get_vocab():
        text = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(tok(text, add_special_tokens=False)["input_ids"])


def post_turn(server: Server, model: str, s: Session, prompt: list[int], answer: int) -> dict:
    r = server.client.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": answer, "temperature": 0, "session_id": s.sid,
        "return_token_ids": True})
    r.raise_for_status()
    return r.json()


def take_turn(server: Server, name: str, s: Session, tok, answer: int, record: list | None = None) -> dict:
    """The session's next turn: its conversation + a user message. Updates the session; appends (sid, prompt,
    answer, usage) to `record` (turns to check against the oracle)."""
    prompt = s.ids + follow_up(tok, int(s.sid[1:]), s.turns) if s.turns else s.ids
    s.in_flight = True
    body = post_turn(server, name, s, prompt, answer)
    got = body["choices"][0]["token_ids"]
    s.ids, s.held, s.done_at, s.in_flight = prompt + got, len(prompt) + len(got) - 1, time.monotonic(), False
    s.turns += 1
    if record is not None:
        record.append({"sid": s.sid, "prompt": prompt, "answer": got, "usage": body["usage"]})
    return body


def burst(pool: ThreadPoolExecutor, fn, sessions: list[Session], server: Server | None = None) -> list:
    try:
        return list(pool.map(fn, sessions))
    except httpx.HTTPError:
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"the server died (status {server.proc.returncode}): "
                               f"{server.log.read_text()[-2000:]}") from None
        raise


def ttft_of(server: Server) -> dict[str, list[dict]]:
    """The server's request_end records per session, in order."""
    out: dict[str, list[dict]] = {}
    for r in server.records("request_end"):
        out.setdefault(r["session_id"], []).append(r)
    return out


def returning(server: Server, name: str, sessions: list[Session], tok, answer: int, pool, record: list,
              probes: int = 8) -> dict:
    """After a restart: the first `probes` sessions' next turns one at a time (the first timed from the process's
    start; each one's TTFT against its turn served alone before), then every other session's next turn in a
    burst. Returns the figures, per session too."""
    held = {s.sid: s.held for s in sessions}
    out: dict = {"ready_s": server.ready - server.started}
    for k, s in enumerate(sessions[:probes]):
        take_turn(server, name, s, tok, answer, record)
        if k == 0:
            out["first_returning_turn_s"] = s.done_at - server.started
    burst(pool, lambda s: take_turn(server, name, s, tok, answer, record), sessions[probes:], server)
    cached = {r["sid"]: r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in record[-len(sessions):]}
    ends = ttft_of(server)
    out["sessions"] = len(sessions)
    out["kept_whole"] = sum(cached[s.sid] >= held[s.sid] for s in sessions)
    out["tokens_held"] = sum(held.values())
    out["tokens_reused"] = sum(min(cached[s.sid], held[s.sid]) for s in sessions)
    out["reused_fraction"] = out["tokens_reused"] / max(out["tokens_held"], 1)
    out["restored_from_disk"] = sum(e[0].get("restored_tokens", {}).get("disk", 0) for e in ends.values())
    out["recomputed"] = sum(e[0]["recomputed_tokens"] for e in ends.values())
    out["probe_turns"] = [{"session": s.sid, "ttft_after_s": ends[s.sid][0]["ttft_s"], "ttft_before_s": s.ttft_before,
                           "ratio": None if not s.ttft_before else ends[s.sid][0]["ttft_s"] / s.ttft_before,
                           "reused": cached[s.sid], "held": held[s.sid]} for s in sessions[:probes]]
    timed = [x for x in out["probe_turns"] if x["ttft_before_s"]]
    if timed:
        after, before = (statistics.median(x[k] for x in timed) for k in ("ttft_after_s", "ttft_before_s"))
        out["probe_median"] = {"turns": len(timed), "ttft_after_s": after, "ttft_before_s": before,
                               "ratio": after / before}
    out["per_session"] = {s.sid: {"held": held[s.sid], "reused": cached[s.sid]} for s in sessions}
    return out


def kill_round(args, server: Server, sessions: list[Session], tok, pool, rng: random.Random) -> dict:
    """Traffic with random pauses; SIGKILL at a random moment of it. Returns each session's state at the kill."""
    stop = threading.Event()

    def loop(s: Session) -> None:
        while not stop.is_set():
            time.sleep(rng.uniform(0, args.think))
            if stop.is_set():
                return
            try:
                take_turn(server, args.name, s, tok, args.answer)
            except (httpx.HTTPError, OSError):
                return                                  # the kill: this turn stays in flight

    threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(args.kill_after[0], args.kill_after[1]))
    t_kill = server.kill()
    stop.set()
    for t in threads:
        t.join(60)
    state = {s.sid: {"age_s": t_kill - s.done_at, "in_flight": s.in_flight, "held": s.held} for s in sessions}
    for s in sessions:
        s.in_flight = False
    return state


def sigterm_round(args, server: Server, tok) -> dict:
    """Long streams and a disconnected client when SIGTERM comes: the streams' end and the exit, timed."""
    ends: dict[str, float] = {}
    reasons: dict[str, str | None] = {}
    started = threading.Barrier(args.streams + 2)

    def stream(k: int) -> None:
        sid = f"long{k}"
        body = {"model": args.name, "prompt": first_prompt(tok, 1000 + k, 12), "max_tokens": args.stream_tokens,
                "temperature": 0, "session_id": sid, "stream": True, "ignore_eos": True}
        chunks = 0
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    reasons[sid] = json.loads(line[6:])["choices"][0]["finish_reason"] or reasons.get(sid)
                    if chunks == 3:
                        started.wait(300)
        ends[sid] = time.monotonic()

    def disconnect() -> None:
        body = {"model": args.name, "prompt": first_prompt(tok, 2000, 12), "max_tokens": args.stream_tokens,
                "temperature": 0, "session_id": "gone", "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    break                               # the client goes away; the turn runs on, cancelled
        started.wait(300)

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(args.streams)]
    threads.append(threading.Thread(target=disconnect, daemon=True))
    for t in threads:
        t.start()
    started.wait(300)
    time.sleep(args.stream_seconds)                     # the streams run on
    t_sig, t_exit = server.term()
    for t in threads:
        t.join(60)
    shut = server.records("shutdown")
    rep = server.records("replica_shutdown")
    out = {"exit_s": t_exit - t_sig, "streams_ended_s": {k: v - t_sig for k, v in ends.items()},
           "finish_reasons": reasons}
    if shut and rep:
        out["drain_s"], out["replicas_s"], out["logged_s"] = shut[0]["drain_s"], shut[0]["replicas_s"], \
            shut[0]["total_s"]
        out["cancel_stop_s"], out["flush_s"], out["close_s"] = rep[0]["cancel_s"], rep[0]["flush_s"], rep[0]["close_s"]
        out["cancelled"] = rep[0]["cancelled"]
        out["flush"] = {k: rep[0][k] for k in ("chunks_written", "tokens_written", "chunks_left", "tokens_left")}
        out["exit_after_log_s"] = out["exit_s"] - shut[0]["total_s"]
    ended = server.records("request_end")
    out["cancelled_turns"] = [{"session": r["session_id"], "finish_reason": r["finish_reason"],
                               "generated": r["generated_tokens"]} for r in ended
                              if r["session_id"] in {f"long{k}" for k in range(args.streams)} | {"gone"}]
    return out


def oracle_check(name: str, record: list[dict], budget: int, threads: int) -> dict:
    """Each recorded turn's answer against stateless greedy `generate` on its prompt (float32, this process, on
    `threads` threads: on a shared host 2 OpenMP threads can be many times slower than 1)."""
    import torch
    torch.set_num_threads(threads)
    model, _ = load(name)
    wrong = []
    t0 = time.monotonic()
    for r in record:
        ids = torch.tensor([r["prompt"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False,
                                 pad_token_id=0)
        want = out[0, len(r["prompt"]):].tolist()
        if want != r["answer"]:
            wrong.append({"sid": r["sid"], "got": r["answer"], "want": want})
    return {"checked": len(record), "wrong": len(wrong), "wrong_turns": wrong[:5], "seconds": time.monotonic() - t0}


def alone(server: Server, name: str, s: Session, tok, answer: int) -> None:
    """The session's next turn with nothing else in flight; its server-side TTFT becomes `ttft_before`."""
    take_turn(server, name, s, tok, answer)
    s.ttft_before = ttft_of(server)[s.sid][-1]["ttft_s"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restart_drill", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3, help="warm-up turns per session")
    p.add_argument("--answer", type=int, default=16, help="max_tokens of a turn (greedy)")
    p.add_argument("--words", type=int, default=24, help="about this many words in a session's first message")
    p.add_argument("--system", help="a system message every session's first prompt starts with (a chat server's "
                   "system prompt: its full chunks are one shared chunk held by every session)")
    p.add_argument("--kills", type=int, default=1)
    p.add_argument("--kill-after", type=float, nargs=2, default=(4.0, 10.0), metavar=("MIN", "MAX"),
                   help="seconds of traffic before a kill: uniform in [MIN, MAX]")
    p.add_argument("--think", type=float, default=12.0, help="a session's pause between turns in a kill round: "
                   "0-THINK s")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=1900)
    p.add_argument("--stream-seconds", type=float, default=2.0, help="the streams run this long before SIGTERM")
    p.add_argument("--verify", type=int, help="sessions sending a turn after the SIGTERM restart (none: all)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--probes", type=int, default=8, help="sessions whose returning turn is timed alone before the "
                   "SIGTERM and after the restart (the first of them: the process's first turn)")
    p.add_argument("--write-behind-delay", type=float, default=1.0)
    p.add_argument("--drain", type=float, default=1.0, help="the queue drain allowed on top of the delay")
    p.add_argument("--shutdown-flush-timeout", type=float, default=4.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--device-tokens", type=int, help="the device tier (none: room for every session); smaller: the "
                   "older sessions live on disk (write-behind's copies), as 10^4 sessions would")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--skip-oracle", action="store_true")
    p.add_argument("--oracle-threads", type=int, default=1, help="torch threads of the oracle's generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="the disk tier's directory (default: a fresh one under /tmp)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "restart_drill.json"))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    from stateful_hf.models import TINY_MODELS
    from stateful_hf.serve.server import TINY_NAME
    args.name = TINY_NAME if args.model in TINY_MODELS else args.model
    _, tok = load(args.model)
    sessions = [Session(f"s{i}", first_prompt(tok, i, args.words, args.system)) for i in range(args.sessions)]
    longest = max(len(s.ids) for s in sessions) + (args.turns + 3 * args.kills + 8) * (args.answer + 32)
    if args.device_tokens is None:         # every session on the device
        args.device_tokens = args.sessions * (longest + 64) + (args.streams + 1) * (args.stream_tokens + 128) + 4096
    args.disk_tokens = 2 * max(args.device_tokens, args.sessions * (longest + 64))     # room for every session
    disk = Path(args.dir or f"/tmp/restart_drill_{os.getpid()}") / "disk"
    logs = disk.parent
    logs.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": {k: v for k, v in vars(args).items()}, "host": {
        "cpus": os.cpu_count(), "load_start": os.getloadavg()[0], "shared": True,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}}
    record: list[dict] = []
    pool = ThreadPoolExecutor(args.concurrency)
    t_all = time.monotonic()

    server = Server(args, disk, logs / "server0.log")
    result["start0_ready_s"] = server.ready - server.started
    t0 = time.monotonic()
    for _ in range(args.turns):
        burst(pool, lambda s: take_turn(server, args.name, s, tok, args.answer), sessions, server)
    result["warmup"] = {"turns": args.turns * args.sessions, "seconds": time.monotonic() - t0}

    kills = []
    for k in range(args.kills):
        state = kill_round(args, server, sessions, tok, pool, rng)
        server = Server(args, disk, logs / f"server_kill{k}.log")
        back = returning(server, args.name, sessions, tok, args.answer, pool, record, probes=0)
        threshold = args.write_behind_delay + args.drain
        eligible = [sid for sid, st in state.items() if not st["in_flight"] and st["age_s"] > threshold]
        whole = {sid for sid, v in back["per_session"].items() if v["reused"] >= v["held"]}
        kills.append({"threshold_s": threshold, "eligible": len(eligible),
                      "eligible_kept_whole": sum(sid in whole for sid in eligible),
                      "in_flight_at_kill": sum(st["in_flight"] for st in state.values()),
                      "not_eligible_kept_whole": sum(sid in whole for sid in state if sid not in eligible),
                      "youngest_kept_whole_s": min((state[sid]["age_s"] for sid in whole), default=None),
                      "oldest_not_kept_whole_s": max((state[sid]["age_s"] for sid in state if sid not in whole),
                                                     default=None),
                      "sessions": {sid: {**state[sid], "reused": back["per_session"][sid]["reused"]}
                                   for sid in state}, "restart": {k: v for k, v in back.items() if k != "per_session"}})
    result["kill9"] = kills

    p = min(args.probes, len(sessions))
    sample = sessions if args.verify is None else sessions[:p] + rng.sample(sessions[p:], max(args.verify - p, 0))
    for s in sample[:p]:
        alone(server, args.name, s, tok, args.answer)        # the TTFTs before, of the turns timed after
    result["sigterm"] = sigterm_round(args, server, tok)
    server = Server(args, disk, logs / "server_term.log")
    back = returning(server, args.name, sample, tok, args.answer, pool, record, p)
    back.pop("per_session")
    result["sigterm"]["restart"] = back
    t_sig, t_exit = server.term()
    result["sigterm"]["idle_exit_s"] = t_exit - t_sig
    result["drill_seconds"] = time.monotonic() - t_all
    result["host"]["load_end"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))     # again with the oracle's verdict
    if not args.skip_oracle:
        result["oracle"] = oracle_check(args.model, record, args.answer, args.oracle_threads)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    summary(result)


def summary(r: dict) -> None:
    t = r["sigterm"]
    b = t["restart"]
    print(f"SIGTERM with {len(t['streams_ended_s'])} streams + 1 disconnected: streams ended "
          f"{max(t['streams_ended_s'].values(), default=0):.2f} s, exit {t['exit_s']:.2f} s after the signal "
          f"(drain {t.get('drain_s', 0):.2f}, flush {t.get('flush_s', 0):.2f}, exit after the log "
          f"{t.get('exit_after_log_s', 0):.2f})")
    print(f"restart: ready {b['ready_s']:.1f} s, first returning turn {b.get('first_returning_turn_s', 0):.1f} s; "
          f"kept {b['kept_whole']}/{b['sessions']}, reused {b['tokens_reused']}/{b['tokens_held']} "
          f"({100 * b['reused_fraction']:.2f} %)")
    for x in b["probe_turns"]:
        print(f"  returning turn alone: {x['session']} TTFT {x['ttft_after_s']:.3f} s after, {x['ttft_before_s']:.3f} "
              f"s before ({x['ratio']:.2f}x), reused {x['reused']}/{x['held']}")
    if "probe_median" in b:
        m = b["probe_median"]
        print(f"  median of {m['turns']} returning turns alone: TTFT {m['ttft_after_s']:.3f} s after, "
              f"{m['ttft_before_s']:.3f} s before ({m['ratio']:.2f}x)")
    for k in r["kill9"]:
        print(f"kill -9: {k['eligible_kept_whole']}/{k['eligible']} eligible kept whole (> {k['threshold_s']} s), "
              f"in flight {k['in_flight_at_kill']}, youngest kept {k['youngest_kept_whole_s']}, "
              f"oldest not kept {k['oldest_not_kept_whole_s']}")
    if "oracle" in r:
        print(f"wrong answers: {r['oracle']['wrong']} of {r['oracle']['checked']}")


if __name__ == "__main__":
    main()
