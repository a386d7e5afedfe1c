"""The command-line flags the server (`python -m stateful_hf.serve`) and the demo (`python -m demo`) share:
the model's (`add_model_flags`) and the session store's (`add_store_flags`), in one place.

Checks run in two passes, each value failing with status 2 and one line (`parser.error`, as argparse's own):
1. before torch or transformers is imported (milliseconds): argparse's types (`--dtype`, the form of
   `--device`, `--log-level`), `check_model` (a named model, a model directory, or a hub id) and
   `read_chat_template` (the file);
2. after torch is imported, before the model loads: `check_device` (the device exists) and
   `store_options` (capacities parse; the policy, hidden-state mode and attention backend are the
   store's own names, `stateful_hf.cache.POLICY_NAMES`, `stateful_hf.cache.hidden.HIDDEN_MODES`,
   `stateful_hf.kernels.BACKENDS`).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# vLLM's --dtype names -> torch's
DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
AUTO_DTYPE = "float32"          # what `--dtype auto` loads today, whatever the checkpoint's dtype
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")     # `name` or `org/name`
CAPACITY = "tokens (digits) or a size such as 2GiB"
# the store's names, as `--help` shows them (tests/test_serve_cli.py checks they are the store's)
POLICIES_HELP = "recency_cost, return_aware, pensieve, lru"
HIDDEN_HELP = "auto, always, never"
BACKENDS_HELP = "auto, torch, triton, flashinfer, flash_attn"


def dtype(text: str) -> str:
    """`--dtype`: a name of DTYPES, as torch's name ("auto" stays "auto": `torch_dtype`)."""
    name = DTYPES.get(text.lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(DTYPES)}")
    return name


def torch_dtype(name: str) -> str:
    """The torch dtype `--dtype name` loads."""
    return AUTO_DTYPE if name == "auto" else name


def device(text: str) -> str:
    """`--device`: `cpu`, `cuda`, `cuda:N`, `mps`, `xpu` (whether it exists: `check_device`)."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not index.isdigit()) or text.endswith(":"):
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DEVICE_TYPES)}, optionally with :INDEX "
                                         f"(cuda:1), got {text!r}")
    return text


def log_level(text: str) -> str:
    """`--log-level`, any case, as the lower-case name."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}; choose from {', '.join(LOG_LEVELS)}")
    return text.lower()


def name_list(text: str) -> list[str]:
    """A list flag: a JSON list (vLLM's `'["http://a.example"]'`) or comma-separated values."""
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            raise argparse.ArgumentTypeError(f"expected a JSON list of non-empty strings, got {text!r}")
        return values
    values = [v.strip() for v in text.split(",")]
    if not all(values):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-empty values, got {text!r}")
    return values


def add_model_flags(p: argparse.ArgumentParser, default_model: str, named: str) -> None:
    """--model, --revision, --trust-remote-code, --dtype, --device, --chat-template. `named`: the
    named models, for the help."""
    p.add_argument("--model", default=default_model,
                   help=f"a named model ({named}), a Hugging Face model directory, or a hub id (ORG/NAME)")
    p.add_argument("--revision", help="the model's branch, tag or commit on the hub (from_pretrained's revision; "
                   "a local directory or a named model ignores it)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code of the model's repository (from_pretrained's trust_remote_code)")
    p.add_argument("--dtype", type=dtype, default="auto",
                   help=f"dtype of the model and its KV: auto ({AUTO_DTYPE} for now), float32/fp32/float, "
                   "bfloat16/bf16, float16/fp16/half")
    p.add_argument("--device", type=device, default="cpu", help="torch device of the model and the device KV tier")
    p.add_argument("--chat-template", metavar="PATH",
                   help="a Jinja chat template file that replaces the tokenizer's")


def add_store_flags(p: argparse.ArgumentParser, device_capacity: str | int, host_capacity: str | int | None) -> None:
    """The session store's flags (`store_options` turns them into SessionStore's keyword arguments)."""
    g = p.add_argument_group("session store (docs/store.md)")
    g.add_argument("--device-capacity", default=device_capacity, help=f"device KV tier: {CAPACITY}")
    g.add_argument("--host-capacity", default=host_capacity,
                   help=f"host KV tier: {CAPACITY}; none or 0: no host tier (memory is taken as it is used)")
    g.add_argument("--disk-dir", help="disk tier directory (persistent; one process per directory); none: no disk tier")
    g.add_argument("--disk-capacity", help=f"disk tier: {CAPACITY}; none: 1GiB with --disk-dir")
    g.add_argument("--chunk-size", type=int, default=32, help="tokens per KV chunk")
    g.add_argument("--hidden-states", metavar="MODE",
                   help=f"keep chunks moving down as hidden states (HCache): {HIDDEN_HELP}; none: the store's "
                   "default (never)")
    g.add_argument("--hidden-capacity", help=f"hidden-state tier: {CAPACITY}; none: --host-capacity")
    g.add_argument("--policy", metavar="NAME",
                   help=f"eviction policy: {POLICIES_HELP}; none: the store's default (recency_cost)")
    g.add_argument("--attention-backend", "--backend", dest="attention_backend", default="auto", metavar="NAME",
                   help=f"paged attention backend: {BACKENDS_HELP}")


def check_model(p: argparse.ArgumentParser, model: str, named: tuple[str, ...]) -> None:
    """`--model` is a named model, a directory with a config.json, or a hub id (ORG/NAME, loaded
    by from_pretrained); a path that does not exist is refused here, before anything loads."""
    if model in named:
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            p.error(f"--model {model}: the directory has no config.json, so it is not a Hugging Face model "
                    "directory")
        return
    if path.exists():
        p.error(f"--model {model}: a file, not a model directory")
    if not HUB_ID.fullmatch(model):
        p.error(f"--model {model}: no such directory, and not a named model ({', '.join(named)}) nor a hub id "
                "(ORG/NAME)")


def read_chat_template(p: argparse.ArgumentParser, path: str | None) -> str | None:
    """The text of `--chat-template PATH` (None: the tokenizer's own template)."""
    if path is None:
        return None
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"--chat-template {path}: {e}")
    if not text.strip():
        p.error(f"--chat-template {path}: the file is empty")
    return text


def check_device(p: argparse.ArgumentParser, name: str) -> None:
    """The torch device `name` exists here (imports torch)."""
    import torch
    dev = torch.device(name)
    if dev.type == "cpu":
        return
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available,
                 "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}[dev.type]
    if not available():
        p.error(f"--device {name}: this torch ({torch.__version__}) has no {dev.type} device; use --device cpu")
    count = getattr(torch, dev.type).device_count()
    if dev.index is not None and dev.index >= count:
        p.error(f"--device {name}: there are {count} {dev.type} devices (0..{count - 1})")


def store_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """SessionStore's keyword arguments from the store flags (imports torch); a bad value exits with
    status 2 naming its flag. Options left unset are absent (the store's defaults apply)."""
    from ..cache import POLICY_NAMES, parse_capacity
    from ..cache.hidden import HIDDEN_MODES
    from ..kernels import BACKENDS

    def capacity(flag: str, value):
        try:
            return None if value is None else parse_capacity(value)
        except ValueError as e:
            p.error(f"{flag}: {e}")

    if a.chunk_size < 1:
        p.error(f"--chunk-size must be >= 1, got {a.chunk_size}")
    for flag, value, names in (("--policy", a.policy, POLICY_NAMES), ("--hidden-states", a.hidden_states, HIDDEN_MODES),
                               ("--attention-backend", a.attention_backend, BACKENDS)):
        if value is not None and value not in names:
            p.error(f"{flag}: unknown {value!r}; choose from {', '.join(names)}")
    host = capacity("--host-capacity", a.host_capacity)
    out = {"device_capacity": capacity("--device-capacity", a.device_capacity),
           "host_capacity": None if host == 0 else host, "disk_dir": a.disk_dir,
           "disk_capacity": capacity("--disk-capacity", a.disk_capacity), "chunk_size": a.chunk_size,
           "attn_backend": a.attention_backend}
    if out["device_capacity"] == 0:
        p.error("--device-capacity must be > 0")
    optional = {"policy": a.policy, "hidden_states": a.hidden_states,
                "hidden_capacity": capacity("--hidden-capacity", a.hidden_capacity)}
    out.update({k: v for k, v in optional.items() if v is not None})
    return out
