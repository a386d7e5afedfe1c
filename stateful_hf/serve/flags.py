"""The command-line flags the server (`python -m stateful_hf.serve`) and the demo (`python -m demo`) share:
the model's (`add_model_flags`) and the session store's (`add_store_flags`), in one place.

Checks run in two passes, each value failing with status 2 and one line (`parser.error`, as argparse's own):
1. before torch or transformers is imported (milliseconds): argparse's types (`--dtype`, the form of
   `--device`, `--log-level`, the policy, hidden-state mode and attention backend: `STORE_NAMES`),
   `check_model` (a named model, a model directory, or a hub id: offline, one the cache holds) and
   `read_chat_template` (the file);
2. after torch is imported, before the model loads: `check_device` (the device exists), `resolve_dtype`
   (what `--dtype` loads there: `auto` by the device's capability) and `store_options` (capacities parse;
   the names are the store's own, `stateful_hf.cache.POLICY_NAMES`, `stateful_hf.cache.hidden.HIDDEN_MODES`,
   `stateful_hf.kernels.BACKENDS`; then the options' own checks).

The store's flags are not written here: they are the options of `SessionStoreOptions` marked `flag`
(`stateful_hf/options/store.py`), with their help and defaults; the engine's are `SchedulingOptions`'
(`add_engine_flags`).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from dataclasses import Field, fields
from enum import Enum
from pathlib import Path

from ..dtypes import NAMES as DTYPES  # vLLM's --dtype names -> torch's (no torch imported)
from ..options import SchedulingOptions, SessionStoreOptions
from . import chat_template

QUANTIZATIONS = ("int8-weight-only", "int8-dynamic")   # stateful_hf.models.SCHEMES (a test keeps them equal)
# `--dtype`'s default: bf16 where the device has bf16 units, float32 elsewhere (docs/server-api.md)
DEFAULT_DTYPE = "auto"
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")     # `name` or `org/name`
# The server's defaults over Engine's (`EngineOptions`): a 256 MiB device tier, up to 256 running requests.
SERVER_DEFAULTS = {"device_capacity": "256MiB", "max_num_seqs": 256}
# The store's names, known before torch is imported (tests/test_serve_cli.py checks they are the store's:
# `stateful_hf.cache.POLICY_NAMES`, `stateful_hf.cache.hidden.HIDDEN_MODES`, `stateful_hf.kernels.BACKENDS`).
STORE_NAMES = {"policy": ("recency_cost", "return_aware", "pensieve", "lru"),
               "hidden_states": ("auto", "always", "never"),
               "attn_backend": ("auto", "torch", "cpu", "triton", "flashinfer", "flash_attn")}


def dtype(text: str) -> str:
    """`--dtype`: a name of DTYPES, as torch's name ("auto" stays "auto": `resolve_dtype`)."""
    name = DTYPES.get(text.lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(DTYPES)}")
    return name


def resolve_dtype(name: str, device: str) -> tuple[str, str | None]:
    """(the torch name of the dtype `--dtype name` loads on `device`, the start-up line that states what
    auto chose and why, or None when a dtype was named): `stateful_hf.dtypes.resolve_dtype` (imports
    torch; call it after `check_device`). The name, not a torch.dtype, is what travels to Ray replicas,
    so that every replica loads what the line stated."""
    from ..dtypes import name_of
    from ..dtypes import resolve_dtype as resolve
    chosen, reason = resolve(name, device)
    line = f"--dtype auto loads {name_of(chosen)} ({reason})" if name == "auto" else None
    return name_of(chosen), line


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
    p.add_argument("--dtype", type=dtype, default=DEFAULT_DTYPE,
                   help="dtype of the model and its KV: float32/fp32/float; auto (bfloat16 on a CPU with bf16 "
                   "units, AMX-BF16 or AVX512-BF16, or on a CUDA GPU with native bf16; float32 elsewhere; said at "
                   "start); bfloat16/bf16 (on a CPU without bf16 units: emulated, slower than float32, a warning); "
                   f"float16/fp16/half. Default: {DEFAULT_DTYPE}")
    p.add_argument("--device", type=device, default="cpu", help="torch device of the model and the device KV tier")
    p.add_argument("--chat-template", metavar="PATH",
                   help="a Jinja chat template file that replaces the tokenizer's")
    p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="load the model quantized through transformers' TorchAoConfig (torchao, the `quant` extra): "
                   "int8-weight-only, or int8-dynamic (int8 activations per token: the store is then "
                   "batch-invariant by default); docs/cpu.md#quantized-models")


def store_flag_fields() -> list[Field]:
    """The options of `SessionStoreOptions` that the command lines offer (marked `flag`), in order."""
    return [f for f in fields(SessionStoreOptions) if f.metadata.get("flag")]


def flag_names(f: Field) -> tuple[str, ...]:
    """An option's flags: `--name-with-dashes`, or the spellings its `flag` lists (the first is its name)."""
    flag = f.metadata["flag"]
    return flag if isinstance(flag, tuple) else ("--" + f.name.replace("_", "-"),)


def _is_capacity(f: Field) -> bool:
    return "TokensOrSize" in str(f.type)


def _value_type(f: Field):
    """What a flag's text converts to: int or float by its option's annotation; capacities and names stay text."""
    t = str(f.type)
    return None if _is_capacity(f) else int if t.startswith("int") else float if t.startswith("float") else None


def add_store_flags(p: argparse.ArgumentParser, device_capacity: str | int, host_capacity: str | int | None) -> None:
    """The session store's flags: every option of `SessionStoreOptions` marked `flag`
    (`stateful_hf/options/store.py`), with its help and default; `device_capacity` and `host_capacity`
    are the command line's own defaults. `store_options` turns them into SessionStore's keyword arguments."""
    g = p.add_argument_group("session store (docs/store.md)")
    own = {"device_capacity": device_capacity, "host_capacity": host_capacity}
    for f in store_flag_fields():
        default = own.get(f.name, f.default)
        text = f.metadata.get("cli") or f.metadata["help"]
        if f.name in STORE_NAMES:
            text += f"; one of {', '.join(STORE_NAMES[f.name])}"
        if str(f.type).startswith("bool"):         # --batch-invariant / --no-batch-invariant
            g.add_argument(*flag_names(f), dest=f.name, default=default, action=argparse.BooleanOptionalAction,
                           help=text)
            continue
        g.add_argument(*flag_names(f), dest=f.name, default=str(default) if isinstance(default, Enum) else default,
                       type=_one_of(STORE_NAMES[f.name]) if f.name in STORE_NAMES else _value_type(f),
                       metavar=f.metadata.get("metavar") or ("TOKENS|SIZE" if _is_capacity(f) else None), help=text)


def _one_of(names: tuple[str, ...]):
    """A flag's type that takes one of `names` (checked before torch is imported, as argparse's own)."""
    def name(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {text!r}; choose from {', '.join(names)}")
        return text
    return name


def check_model(p: argparse.ArgumentParser, model: str, named: tuple[str, ...], revision: str | None = None) -> str:
    """The model to load for `--model` (or the positional MODEL): a named model, a directory with a
    config.json, or a hub id (ORG/NAME, loaded by from_pretrained); a hub id of a named model is that
    named model (`models.bundled`: `HuggingFaceTB/SmolLM2-135M-Instruct` -> `smollm2-135m-instruct`,
    offline). Refused here, before anything loads: a path that does not exist, and a hub id the local
    cache does not hold while the hub is offline ($HF_HUB_OFFLINE) or unreachable (no network: one TCP
    connection tried, `models.hub_reachable`; no hub request), naming the closest known models."""
    from ..models import bundled, hub_reachable
    if model in named:
        return model
    own = bundled(model)
    if own is not None:
        return own
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            p.error(f"--model {model}: the directory has no config.json, so it is not a Hugging Face model "
                    "directory")
        return model
    if path.exists():
        p.error(f"--model {model}: a file, not a model directory")
    hint = _did_you_mean(model, named)
    if not HUB_ID.fullmatch(model):
        p.error(f"--model {model}: no such model path or known model: not a directory, not a named model "
                f"({', '.join(named)}) nor a hub id (ORG/NAME){hint}")
    from huggingface_hub import constants, try_to_load_from_cache  # no torch; ~0.2 s
    if isinstance(try_to_load_from_cache(model, "config.json", revision=revision), str):
        return model
    why = "the hub is offline (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else \
        None if hub_reachable() else f"the hub ({constants.ENDPOINT}) cannot be reached (no network)"
    if why is not None:
        p.error(f"--model {model}: no such model path or known model: not a directory, not a named model "
                f"({', '.join(named)}), and as a hub id not in the local cache while {why}{hint}")
    return model


def _did_you_mean(model: str, named: tuple[str, ...]) -> str:
    """"; did you mean X?" over the named models, their hub ids and the hub ids the local cache holds
    (case-insensitive), or ""."""
    from ..models import SOURCES
    known = {n.lower(): n for n in named} | {s.hub_id.lower(): s.hub_id for s in SOURCES.values()}
    known |= {n.lower(): n for n in _cached_hub_ids()}
    text = model.lower().rstrip("/")
    close = [known[k] for k in known if k.startswith(text) or (text and k.endswith("/" + text))]
    close = close or [known[k] for k in difflib.get_close_matches(text, list(known), n=2, cutoff=0.6)]
    close = close or [known[k] for k in difflib.get_close_matches(text.rpartition("/")[2], list(known), n=1)]
    return f"; did you mean {' or '.join(dict.fromkeys(close))}?" if close else ""


def _cached_hub_ids() -> list[str]:
    """ORG/NAME of the models in the local hub cache ($HF_HUB_CACHE: `models--ORG--NAME` directories)."""
    from huggingface_hub import constants
    root = Path(constants.HF_HUB_CACHE)
    try:
        dirs = [d.name for d in root.iterdir() if d.name.startswith("models--")]
    except OSError:
        return []
    return [d.removeprefix("models--").replace("--", "/", 1) for d in dirs]


def read_chat_template(p: argparse.ArgumentParser, path: str | None) -> str | None:
    """The text of `--chat-template PATH` (None: the tokenizer's own template), read before torch is
    imported (`chat_template.read_chat_template`); an unreadable or empty file exits with status 2."""
    if path is None:
        return None
    try:
        return chat_template.read_chat_template(path)
    except ValueError as e:
        p.error(f"--chat-template {path}: {e}")


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


def add_engine_flags(p: argparse.ArgumentParser, **defaults) -> None:
    """The engine's scheduling flags: the options of `SchedulingOptions` marked `flag`
    (`stateful_hf/options/engine.py`), with their help; `defaults` are the command line's own."""
    for f in fields(SchedulingOptions):
        if f.metadata.get("flag"):
            p.add_argument(*flag_names(f), dest=f.name, type=int, default=defaults.get(f.name, f.default),
                           help=f.metadata["help"])


def engine_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """Engine's scheduling keyword arguments from its flags; a bad value exits with status 2 naming its flag."""
    out = {f.name: getattr(a, f.name) for f in fields(SchedulingOptions) if f.metadata.get("flag")}
    try:
        SchedulingOptions.build(**out)
    except ValueError as e:
        p.error(as_flags(str(e), SchedulingOptions))
    return out


def store_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """SessionStore's keyword arguments from the store flags, one per flag (imports torch); a bad value
    exits with status 2 naming its flag. Capacities parse (`parse_capacity`; a host capacity of 0 is no
    host tier); the policy, hidden-state mode and attention backend are the store's own names; then
    `SessionStoreOptions` checks the whole, as the store will."""
    from ..cache import POLICY_NAMES, parse_capacity
    from ..cache.hidden import HIDDEN_MODES
    from ..kernels import BACKENDS

    names = {"policy": POLICY_NAMES, "hidden_states": HIDDEN_MODES, "attn_backend": BACKENDS}
    out = {}
    for f in store_flag_fields():
        flag, value = flag_names(f)[0], getattr(a, f.name)
        if value is not None and _is_capacity(f):
            try:
                value = parse_capacity(value)
            except ValueError as e:
                p.error(f"{flag}: {e}")
            if f.name == "host_capacity" and value == 0:
                value = None
        elif value is not None and f.name in names and value not in names[f.name]:
            p.error(f"{flag}: unknown {value!r}; choose from {', '.join(names[f.name])}")
        out[f.name] = value
    try:
        SessionStoreOptions.build(**out)
    except ValueError as e:
        p.error(as_flags(str(e), SessionStoreOptions))
    return out


def as_flags(message: str, *options) -> str:
    """A check message of the options ("chunk_size must be >= 1, ...", "hidden_states='always' needs ...
    hidden_capacity") with each option that is a flag named as its flag (`--chunk-size must be ...`,
    `--hidden-states 'always' needs ... --hidden-capacity`). A name without an underscore (`policy`) is
    replaced only where the message starts with it: elsewhere it may be a plain word."""
    for f in (f for o in options for f in fields(o) if f.metadata.get("flag")):
        flag = flag_names(f)[0]
        at = "" if "_" in f.name else "^"
        message = re.sub(rf"{at}\b{f.name}\b(=?)", lambda m, flag=flag: flag + (" " if m.group(1) else ""), message)
    return message
