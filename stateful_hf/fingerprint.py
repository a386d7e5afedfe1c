"""The fingerprint of a model, which the disk tier records so it never serves one model's KV to another."""

from __future__ import annotations

import hashlib
import json

import torch

SAMPLES_PER_TENSOR = 256


@torch.no_grad()
def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex, 32 chars) of the model's config (public keys, sorted) and of a sample of every
    parameter and buffer: its name, shape, dtype and SAMPLES_PER_TENSOR evenly spaced values. A
    fine-tune of the same geometry changes the sample; the cost is independent of the model's size."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, t in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda nt: nt[0]):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        for part, inner in _parts(t.detach()):
            if part:            # a plain tensor's hash is as before (saved disk tiers keep their fingerprint)
                h.update(f"{part}|{tuple(inner.shape)}|{inner.dtype}".encode())
            _sample(h, inner)
    return h.hexdigest()[:32]


def _parts(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A plain tensor, or a quantized weight's inner tensors (a torchao subclass: its int8 data and scales)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return [("", t)]
    names, meta = t.__tensor_flatten__()        # torchao's weights are traceable wrapper subclasses
    scheme = f"{type(t).__name__}{sorted(meta.items(), key=str)}"     # e.g. its activations' quantization
    return [(f"{scheme}.{n}", getattr(t, n)) for n in names]


def _sample(h, t: torch.Tensor) -> None:
    """SAMPLES_PER_TENSOR evenly spaced values of `t` into the hash."""
    flat = t.reshape(-1)
    if flat.numel():
        m = min(SAMPLES_PER_TENSOR, flat.numel())
        idx = (torch.arange(m, dtype=torch.int64) * (flat.numel() - 1) // max(m - 1, 1)).to(flat.device)
        h.update(flat[idx].float().cpu().numpy().tobytes())
