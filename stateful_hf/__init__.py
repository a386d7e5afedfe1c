"""stateful-hf: keep each conversation's attention state across turns for Hugging Face models."""

from .adapter import UnsupportedModelError
from .cache import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .engine import Engine, RequestOutput, SamplingParams
from .engine.hints import Hint
from .integration import enable
from .pipeline import StatefulTextGenerationPipeline, pipeline
from .session_store import SessionStore
from .stateful_cache import StatefulCache

__all__ = [
    "CapacityError", "SessionBusyError", "SessionStore", "StatefulCache", "StoreError", "UnknownSessionError",
    "UnsupportedModelError", "enable",
]
__all__ += ["Engine", "RequestOutput", "SamplingParams"]
__all__ += ["Hint", "StatefulTextGenerationPipeline", "pipeline"]
__version__ = "0.1.0"
