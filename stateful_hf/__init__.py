"""stateful-hf: keep each conversation's attention state across turns for Hugging Face models."""

from .adapter import UnsupportedModelError
from .cache import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .engine import Engine, RequestOutput, SamplingParams
from .integration import enable
from .stateful_cache import StatefulCache
from .store import SessionStore

__all__ = [
    "CapacityError", "SessionBusyError", "SessionStore", "StatefulCache", "StoreError", "UnknownSessionError",
    "UnsupportedModelError", "enable",
]
__all__ += ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
