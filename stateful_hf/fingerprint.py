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
        flat = t.detach().reshape(-1)
        if flat.numel():
            m = min(SAMPLES_PER_TENSOR, flat.numel())
            idx = (torch.arange(m, dtype=torch.int64) * (flat.numel() - 1) // max(m - 1, 1)).to(flat.device)
            h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]
