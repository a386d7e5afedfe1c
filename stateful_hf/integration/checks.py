"""Checks of a stateful `generate` call's input ids, before transformers sees them: one unpadded sequence of
valid ids that fits the model (`check_input_ids`), and no pad id that stateless `generate` would mask
(`check_pad_ids`)."""

from __future__ import annotations

import copy

import torch

from .adapter import ModelAdapter


def check_input_ids(input_ids, adapter: ModelAdapter) -> list[int]:
    """Validate one sequence of prompt ids; returns them as a list."""
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got {input_ids.dtype}")
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"generate with a StatefulCache serves one session (batch size 1), got batch "
                             f"{input_ids.shape[0]}; use stateful_hf.Engine to serve many sessions together")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [1, n] or [n], got shape {tuple(input_ids.shape)}")
    ids = input_ids.tolist()
    if not ids:
        raise ValueError("empty prompt: input_ids has no tokens")
    bad = [t for t in ids if not 0 <= t < adapter.vocab_size]
    if bad:
        raise ValueError(f"invalid token ids {bad[:5]}: the model's vocabulary is 0..{adapter.vocab_size - 1}")
    if len(ids) >= adapter.max_positions:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of {adapter.max_positions}")
    return ids


def check_pad_ids(model, input_ids, ids: list[int], kwargs: dict) -> None:
    """Refuse where stateless `generate` would infer an attention mask that hides pad ids: a session's
    history has no holes, so the stateful path would attend to them and silently differ. The rule of
    transformers 5.23 (`_prepare_attention_mask_for_generation`, with the generation config
    `generate` would use): no attention_mask given, ids a 2-D int32/int64 tensor (or a list), the
    effective pad_token_id set and present in the ids, and no EOS id equal to it (an unset pad id
    defaults to the first EOS id, which is never inferred)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dtype not in (torch.int32, torch.int64):
        return
    config = _generation_config(model, kwargs)
    pad, eos = _id_list(config.pad_token_id), _id_list(config.eos_token_id)
    hidden = sorted(set(pad) & set(ids) - set(eos))
    if pad and hidden:
        raise ValueError(
            f"input_ids contain the pad token id {hidden[0]} and no attention_mask was given: stateless generate "
            "would infer a mask hiding those tokens, which a StatefulCache cannot do (a session's history has no "
            "holes). If the pad ids are meant as text, pass an all-ones attention_mask "
            "(attention_mask=torch.ones_like(input_ids)); otherwise remove the padding")


def _generation_config(model, kwargs: dict):
    """The generation config `generate(**kwargs)` would use (transformers' own merge, private API)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    rest = {k: v for k, v in kwargs.items() if k != "generation_config"}
    if prepare is not None:
        return prepare(kwargs.get("generation_config"), **rest)[0]
    # without it: the explicit kwargs over the given or the model's config
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**rest)
    return config


def _id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
