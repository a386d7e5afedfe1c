"""stateful-hf: keep each conversation's attention state across turns for Hugging Face models.

The names below load on first use (PEP 562): `import stateful_hf` imports neither torch nor
transformers, so `python -m stateful_hf.serve` checks its flags in milliseconds. The first name used
imports them all (and registers `transformers.pipeline("stateful-text-generation", ...)`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:   # the same names, for type checkers and IDEs
    from .cache import CapacityError, SessionBusyError, StoreError, UnknownSessionError
    from .engine import Engine, RequestOutput, SamplingParams
    from .engine.hints import Hint
    from .integration.adapter import UnsupportedModelError
    from .integration.hooks import enable
    from .integration.pipeline import StatefulTextGenerationPipeline, pipeline
    from .integration.session_store import SessionStore
    from .integration.stateful_cache import StatefulCache
    from .kernels.invariance import batch_invariant

__all__ = [
    "CapacityError", "SessionBusyError", "SessionStore", "StatefulCache", "StoreError", "UnknownSessionError",
    "UnsupportedModelError", "enable",
]
__all__ += ["Engine", "RequestOutput", "SamplingParams"]
__all__ += ["Hint", "StatefulTextGenerationPipeline", "batch_invariant", "pipeline"]
__version__ = "0.1.0"


def _facade() -> dict:
    """The public names, imported (torch and transformers with them)."""
    from .cache import CapacityError, SessionBusyError, StoreError, UnknownSessionError
    from .engine import Engine, RequestOutput, SamplingParams
    from .engine.hints import Hint
    from .integration.adapter import UnsupportedModelError
    from .integration.hooks import enable
    from .integration.pipeline import StatefulTextGenerationPipeline, pipeline
    from .integration.session_store import SessionStore
    from .integration.stateful_cache import StatefulCache
    from .kernels.invariance import batch_invariant
    return {"batch_invariant": batch_invariant, "CapacityError": CapacityError,
            "SessionBusyError": SessionBusyError, "SessionStore": SessionStore,
            "StatefulCache": StatefulCache, "StoreError": StoreError, "UnknownSessionError": UnknownSessionError,
            "UnsupportedModelError": UnsupportedModelError, "enable": enable, "Engine": Engine,
            "RequestOutput": RequestOutput, "SamplingParams": SamplingParams, "Hint": Hint,
            "StatefulTextGenerationPipeline": StatefulTextGenerationPipeline, "pipeline": pipeline}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _facade)
