"""The drop-in pipeline: transformers' text-generation pipeline whose `generate` goes through a
session's StatefulCache, so a conversation called again with its growing message list computes only
the new tokens.

    chat = stateful_hf.pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = chat(messages, session_id="alice", max_new_tokens=64)

Everything else is transformers' `TextGenerationPipeline` unchanged (chat messages, plain text,
generation kwargs, `return_full_text`, `return_tensors`, stop sequences, batches). Without
`session_id` a call is stateless, exactly as in transformers. Importing stateful_hf also registers
the task "stateful-text-generation" with `transformers.pipeline`.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import AutoModelForCausalLM
from transformers.pipelines import PIPELINE_REGISTRY, TextGenerationPipeline
from transformers.pipelines import pipeline as _hf_pipeline

from ..options import SessionStoreOptions
from .session_store import SessionStore

TASK = "stateful-text-generation"
_STORE_KEYS = SessionStoreOptions.names()     # also accepted as top-level pipeline kwargs


class StatefulTextGenerationPipeline(TextGenerationPipeline):
    """`TextGenerationPipeline` plus `session_id=` per call (a string, or one per input of a batch).

    store: a `stateful_hf.SessionStore` of this pipeline's model, or None to make one on first use
        from `store_kwargs` (e.g. device_capacity=4096, host_capacity="1GiB").
    """

    def __init__(self, *args, store: SessionStore | None = None, store_kwargs: dict | None = None, **kwargs):
        store_kwargs = dict(store_kwargs or {})
        for key in _STORE_KEYS:
            if key in kwargs:
                store_kwargs[key] = kwargs.pop(key)
        SessionStoreOptions.build(**store_kwargs)        # TypeError / ValueError now, not at the first call
        if store is not None and store_kwargs:
            raise ValueError(f"pass either store= or store options {sorted(store_kwargs)}, not both")
        super().__init__(*args, **kwargs)
        if store is not None and store.model is not self.model:
            raise ValueError("the store belongs to another model than this pipeline's")
        self._store, self._store_kwargs = store, store_kwargs

    @property
    def store(self) -> SessionStore:
        """The session store (made on first use)."""
        if self._store is None:
            self._store = SessionStore(self.model, **self._store_kwargs)
        return self._store

    def __call__(self, text_inputs, session_id: str | Sequence[str] | None = None, **kwargs):
        if session_id is None:
            return super().__call__(text_inputs, **kwargs)
        batch = _is_batch(text_inputs)
        if isinstance(session_id, str):
            if batch:
                raise ValueError(f"session_id={session_id!r} names one conversation but {len(text_inputs)} inputs "
                                 "were given; pass one session id per input (a list)")
            if kwargs.get("num_return_sequences", 1) != 1 or kwargs.get("num_beams", 1) != 1:
                raise ValueError("a session holds one conversation: num_return_sequences and num_beams must be 1")
            return super().__call__(text_inputs, _stateful_session=session_id, **kwargs)
        session_ids = list(session_id)
        if not batch or len(session_ids) != len(text_inputs):
            n = len(text_inputs) if batch else 1
            raise ValueError(f"{len(session_ids)} session ids for {n} input(s): pass one per input of a batch")
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a session id appears twice in one batch: one session holds one conversation")
        kwargs.pop("batch_size", None)           # one sequence per generate call with a StatefulCache
        return [self(x, session_id=s, **kwargs) for x, s in zip(text_inputs, session_ids)]

    def _sanitize_parameters(self, _stateful_session: str | None = None, **kwargs):
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        if _stateful_session is not None:
            forward["_stateful_session"] = _stateful_session
        return preprocess, forward, postprocess

    def _forward(self, model_inputs, _stateful_session: str | None = None, **generate_kwargs):
        if _stateful_session is not None:
            if "past_key_values" in generate_kwargs:
                raise ValueError("pass session_id= or past_key_values=, not both")
            generate_kwargs["past_key_values"] = self.store.cache(_stateful_session)
        return super()._forward(model_inputs, **generate_kwargs)


def _is_batch(inputs) -> bool:
    """A list of prompts or of chats (not one chat, which is a list of message dicts)."""
    if not isinstance(inputs, (list, tuple)) or not inputs:
        return False
    first = inputs[0]
    return isinstance(first, str) or (isinstance(first, (list, tuple)) and not isinstance(first, dict))


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs) -> StatefulTextGenerationPipeline:
    """`transformers.pipeline` for text generation, made stateful: calls accept `session_id=`.

    `task` is "text-generation" (or "stateful-text-generation"); other kwargs (device, dtype,
    generation defaults, store options such as device_capacity / host_capacity, or store=) go to
    transformers' `pipeline` and the pipeline class."""
    if task not in ("text-generation", TASK):
        raise ValueError(f"stateful_hf.pipeline serves 'text-generation', got task {task!r}; use "
                         "transformers.pipeline for other tasks")
    return _hf_pipeline(TASK, model=model, tokenizer=tokenizer, **kwargs)


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=StatefulTextGenerationPipeline,
                                    pt_model=AutoModelForCausalLM, type="text")
