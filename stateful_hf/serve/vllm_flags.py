"""vLLM's launch flags on this server: `python -m stateful_hf.serve MODEL --enable-prefix-caching ...`
starts as `vllm serve MODEL ...` does, each flag with its meaning here or a one-line answer.

`VLLM_FLAGS` is the hand-written list (docs/server-api.md, "Flags from vLLM", says the same), each flag
with its `FlagStatus`:
- MAPPED: sets what the server has under its own name (`--swap-space 4` is `--host-capacity 4GiB`);
- ACCEPTED: already what the server does (`--enable-auto-tool-choice`); one line says so;
- CHECKED: accepted at the one value that is true here (`--block-size` = `--chunk-size`, `--kv-cache-dtype
  auto`, `--tensor-parallel-size 1`), any other refused with status 2 naming it;
- NO_MEANING: nothing here corresponds (`--disable-log-stats`); one line says so and the server starts.

Checks run in `flags.py`'s two passes: `check_vllm_flags` before torch is imported (values, conflicts,
parser names), `device_tier` after the model loaded (`--gpu-memory-utilization`, which needs the device's
memory). The lines are returned, not printed: the caller logs them once logging is configured.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass


class FlagStatus(enum.Enum):
    MAPPED = "mapped"
    ACCEPTED = "accepted"
    CHECKED = "checked"
    NO_MEANING = "no meaning here"


@dataclass(frozen=True, slots=True)
class VllmFlag:
    """One vLLM flag: its spellings, what it takes (argparse's `nargs`/`type`), its status and meaning here."""

    names: tuple[str, ...]
    status: FlagStatus
    meaning: str
    takes: type | None = None        # None: a switch


TOOL_CALL_PARSERS = ("hermes",)       # the `<tool_call>` JSON lines of tools.py's shipped format
REASONING_PARSERS = ("qwen3",)        # `<think>...</think>` first, read by reasoning.py

VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--enable-prefix-caching",), FlagStatus.MAPPED, "prefix sharing on (the store's prefix_sharing; "
             "docs/prefix-sharing.md); default: on where the store can share"),
    VllmFlag(("--no-enable-prefix-caching",), FlagStatus.MAPPED, "prefix sharing off"),
    VllmFlag(("--enable-auto-tool-choice",), FlagStatus.ACCEPTED, "tool_choice auto is always on (docs/agents.md)"),
    VllmFlag(("--tool-call-parser",), FlagStatus.CHECKED, "tool calls are read in the chat template's format: the "
             "tokenizer's response template, else Hermes `<tool_call>` JSON; names: " + ", ".join(TOOL_CALL_PARSERS),
             str),
    VllmFlag(("--reasoning-parser",), FlagStatus.CHECKED, "`<think>` blocks are read wherever the chat template "
             "has them; names: " + ", ".join(REASONING_PARSERS), str),
    VllmFlag(("--gpu-memory-utilization",), FlagStatus.MAPPED, "on a GPU, the device KV tier is this share of the "
             "device's memory less what the model took at load (activations come out of the rest); "
             "no meaning on the CPU", float),
    VllmFlag(("--swap-space",), FlagStatus.MAPPED, "the host KV tier in GiB (--host-capacity NGiB); 0: none", float),
    VllmFlag(("--max-num-batched-tokens",), FlagStatus.MAPPED, "--max-batch-tokens", int),
    VllmFlag(("--max-num-seqs",), FlagStatus.MAPPED, "the engine's own --max-num-seqs"),
    VllmFlag(("--block-size",), FlagStatus.CHECKED, "must equal --chunk-size (the store's chunk is its block)", int),
    VllmFlag(("--enable-chunked-prefill",), FlagStatus.ACCEPTED, "prefills are always chunked (to --max-batch-tokens)"),
    VllmFlag(("--kv-cache-dtype",), FlagStatus.CHECKED, "auto only: the KV is in the model's --dtype", str),
    VllmFlag(("--disable-log-requests",), FlagStatus.MAPPED, "no per-request log line (logger stateful_hf.requests "
             "at WARNING)"),
    VllmFlag(("--api-key",), FlagStatus.MAPPED, "the server's own --api-key (also $VLLM_API_KEY)"),
    VllmFlag(("--enforce-eager",), FlagStatus.MAPPED, "the engine's steps run eager: --compile off"),
    VllmFlag(("--tensor-parallel-size", "-tp"), FlagStatus.CHECKED, "1 only; replicas on Ray Serve are data "
             "parallelism (--ray --replicas N)", int),
    VllmFlag(("--pipeline-parallel-size", "-pp"), FlagStatus.CHECKED, "1 only (one device per replica)", int),
    VllmFlag(("--data-parallel-size", "-dp"), FlagStatus.CHECKED, "1 only here; data parallelism is --ray --replicas N",
             int),
    VllmFlag(("--disable-log-stats",), FlagStatus.NO_MEANING, "there is no periodic stats line to disable (/metrics)"),
    VllmFlag(("--uvicorn-log-level",), FlagStatus.NO_MEANING, "uvicorn logs at --log-level", str),
    VllmFlag(("--disable-frontend-multiprocessing",), FlagStatus.NO_MEANING, "the HTTP front end and the engine share "
             "one process"),
    VllmFlag(("--disable-fastapi-docs",), FlagStatus.NO_MEANING, "the server serves no /docs pages"),
    VllmFlag(("--max-seq-len-to-capture",), FlagStatus.NO_MEANING, "no CUDA graphs are captured", int),
    VllmFlag(("--disable-custom-all-reduce",), FlagStatus.NO_MEANING, "no tensor parallelism, no all-reduce"),
    VllmFlag(("--distributed-executor-backend",), FlagStatus.NO_MEANING, "one process per replica (--ray: Ray Serve)",
             str),
    VllmFlag(("--enable-prompt-tokens-details",), FlagStatus.NO_MEANING, "usage always carries "
             "prompt_tokens_details.cached_tokens"),
)
BY_NAME = {n: f for f in VLLM_FLAGS for n in f.names}
# flags the server already has under vLLM's name (their own argparse actions; not added here)
OWN = ("--max-num-seqs", "--api-key")


def _dest(name: str) -> str:
    return "vllm_" + name.lstrip("-").replace("-", "_")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags (`VLLM_FLAGS`) in a group of their own; each unset stays absent from the namespace
    (`argparse.SUPPRESS`), so `given(a)` is what the command line said."""
    g = p.add_argument_group("vLLM's flags (docs/server-api.md, \"Flags from vLLM\")")
    for f in VLLM_FLAGS:
        if f.names[0] in OWN:
            continue
        kw = {"action": "store_true"} if f.takes is None else {"type": f.takes, "metavar": f.takes.__name__.upper()}
        g.add_argument(*f.names, dest=_dest(f.names[0]), default=argparse.SUPPRESS,
                       help=f"{f.status.value}: {f.meaning}", **kw)


def given(a: argparse.Namespace) -> dict[str, object]:
    """{flag: value} of the vLLM flags the command line gave (own flags excluded)."""
    return {f.names[0]: getattr(a, _dest(f.names[0])) for f in VLLM_FLAGS
            if f.names[0] not in OWN and hasattr(a, _dest(f.names[0]))}


def check_vllm_flags(p: argparse.ArgumentParser, a: argparse.Namespace, argv: list[str]) -> list[str]:
    """Pass 1 (no torch): apply the vLLM flags to the server's own options in `a`, refuse a value that is
    not true here (status 2, one line naming the flag); returns the lines to log. Sets `a.prefix_sharing`
    (None: the store's default) and `a.gpu_memory_utilization` (None: not given)."""
    vals, lines = given(a), []
    said = {arg.split("=", 1)[0] for arg in argv if arg.startswith("-")}
    a.prefix_sharing, a.gpu_memory_utilization = None, None
    if "--enable-prefix-caching" in vals and "--no-enable-prefix-caching" in vals:
        p.error("--enable-prefix-caching and --no-enable-prefix-caching: give one")
    if "--enable-prefix-caching" in vals:
        a.prefix_sharing = True
    if "--no-enable-prefix-caching" in vals:
        a.prefix_sharing = False
    if "--enforce-eager" in vals:
        if "--compile" in said and a.compile != "off":
            p.error(f"--enforce-eager and --compile {a.compile} disagree: give one")
        a.compile = "off"
    parser = vals.get("--tool-call-parser")
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        p.error(f"--tool-call-parser {parser}: not a format this server reads; supported: "
                f"{', '.join(TOOL_CALL_PARSERS)} (tool calls follow the chat template's format)")
    parser = vals.get("--reasoning-parser")
    if parser is not None and parser not in REASONING_PARSERS:
        p.error(f"--reasoning-parser {parser}: not a format this server reads; supported: "
                f"{', '.join(REASONING_PARSERS)} (<think> blocks, read wherever the chat template has them)")
    share = vals.get("--gpu-memory-utilization")
    if share is not None:
        if not 0 < share <= 1:
            p.error(f"--gpu-memory-utilization must be in (0, 1], got {share}")
        if "--device-capacity" in said:
            p.error("--gpu-memory-utilization and --device-capacity both size the device tier: give one")
        if a.device.split(":")[0] == "cpu":
            lines.append("--gpu-memory-utilization has no meaning on the CPU (--device cpu): the device tier is "
                         f"--device-capacity ({a.device_capacity})")
        elif a.ray:
            p.error("--gpu-memory-utilization: with --ray each replica's device tier is --device-capacity "
                    "(a size such as 20GiB)")
        else:
            a.gpu_memory_utilization = share
    swap = vals.get("--swap-space")
    if swap is not None:
        if not swap >= 0:
            p.error(f"--swap-space must be >= 0 GiB, got {swap}")
        if "--host-capacity" in said:
            p.error("--swap-space and --host-capacity both size the host tier: give one")
        a.host_capacity = f"{swap:g}GiB" if swap else None
    tokens = vals.get("--max-num-batched-tokens")
    if tokens is not None:
        if "--max-batch-tokens" in said and tokens != a.max_batch_tokens:
            p.error("--max-num-batched-tokens and --max-batch-tokens disagree: give one")
        a.max_batch_tokens = tokens
    block = vals.get("--block-size")
    if block is not None and block != a.chunk_size:
        p.error(f"--block-size {block}: the store's block is its chunk of --chunk-size {a.chunk_size} tokens; give "
                f"--block-size {a.chunk_size}, or --chunk-size {block} alone")
    kv = vals.get("--kv-cache-dtype")
    if kv is not None and kv != "auto":
        p.error(f"--kv-cache-dtype {kv}: the KV cache is kept in the model's dtype here (--dtype); only auto")
    for name, also in (("--tensor-parallel-size", "replicas on Ray Serve are data parallelism: --ray --replicas N"),
                       ("--pipeline-parallel-size", "one device per replica; replicas: --ray --replicas N"),
                       ("--data-parallel-size", "data parallelism here is --ray --replicas N")):
        n = vals.get(name)
        if n is not None and n != 1:
            p.error(f"{name} {n}: not supported (one device per replica); {also}")
    for name, value in vals.items():
        f = BY_NAME[name]
        if f.status in (FlagStatus.ACCEPTED, FlagStatus.NO_MEANING):
            shown = name if f.takes is None else f"{name} {value}"
            said = "accepted" if f.status is FlagStatus.ACCEPTED else "no meaning here"
            lines.append(f"{shown}: {said}: {f.meaning}")
    return lines


def device_tier(share: float, device: str) -> str:
    """`--gpu-memory-utilization share` as the device tier's size: `share` of the device's memory less what
    torch holds there now (the loaded model), in bytes ("NNNB", `parse_capacity`'s form). ValueError when
    nothing is left."""
    import torch
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    held = torch.cuda.memory_reserved(torch.device(device))
    room = int(share * total) - held
    if room <= 0:
        raise ValueError(f"--gpu-memory-utilization {share}: {share} of the device's {total / 2**30:.1f} GiB is "
                         f"less than the {held / 2**30:.1f} GiB the model holds")
    return f"{room}B"


def did_you_mean(p: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit with status 2 naming the first unknown flag and the closest known ones."""
    import difflib
    flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=", 1)[0]
    close = difflib.get_close_matches(flag, sorted(p._option_string_actions), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else " (--help lists the flags)"
    p.error(f"unrecognized arguments: {' '.join(unknown)}: {flag} is not a flag of this server{hint}")
