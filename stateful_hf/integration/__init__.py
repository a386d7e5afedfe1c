"""The seam with transformers, the one package that imports it besides the model loader (`stateful_hf.models`):
an unmodified transformers model made stateful (`hooks.enable`), the registered attention (`attention.py`), the
step context (`context.py`), the input checks (`checks.py`), per-family facts (`adapter.py`), the HCache
projector (`projector.py`), the transformers `Cache` view of a session (`stateful_cache.py`), the store sized
from a model (`session_store.py`) and the pipeline drop-in (`pipeline.py`). docs/step.md, docs/store.md.

The names below load on first use (PEP 562, as the package root's): importing a submodule (the profiles import
`hooks.run_step`, and `session_store` imports the profiles) runs no other submodule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:   # the same names, for type checkers and IDEs
    from .adapter import ModelAdapter, UnsupportedModelError, adapter_for, decoder_layers
    from .hooks import enable, run_step
    from .session_store import SessionStore
    from .stateful_cache import StatefulCache

__all__ = ["ModelAdapter", "SessionStore", "StatefulCache", "UnsupportedModelError", "adapter_for",
           "decoder_layers", "enable", "run_step"]


def _names() -> dict:
    from .adapter import ModelAdapter, UnsupportedModelError, adapter_for, decoder_layers
    from .hooks import enable, run_step
    from .session_store import SessionStore
    from .stateful_cache import StatefulCache
    return {"ModelAdapter": ModelAdapter, "UnsupportedModelError": UnsupportedModelError, "adapter_for": adapter_for,
            "decoder_layers": decoder_layers, "enable": enable, "run_step": run_step, "SessionStore": SessionStore,
            "StatefulCache": StatefulCache}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _names)
