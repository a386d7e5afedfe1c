"""The store's and the engine's options, declared once: frozen dataclasses whose fields carry their
defaults, a one-line doc and whether the command lines offer them as flags; their checks run at
construction. Plain data: this package imports neither torch nor the rest of stateful_hf, so every
layer uses it, and the server and the demo build and check their flags from it before torch loads.

    StoreOptions, SessionStoreOptions, StoreConfig    the stores' (store.py)
    SchedulingOptions, EngineConfig                    the engine's (engine.py)
    Layout, HiddenStates, OnBusy, GenerationConfigMode, PrepackWeights the modes (modes.py: string enums)
"""

from .declare import TokensOrSize, Unpack, check_known, option
from .engine import EngineConfig, EngineConfigKwargs, EngineKwargs, SchedulingOptions, split_engine_options
from .modes import GenerationConfigMode, HiddenStates, Layout, Mode, OnBusy, PrepackWeights
from .store import KVStoreKwargs, SessionStoreKwargs, SessionStoreOptions, StoreConfig, StoreKwargs, StoreOptions

__all__ = [
    "EngineConfig", "EngineConfigKwargs", "EngineKwargs", "GenerationConfigMode", "HiddenStates", "KVStoreKwargs",
    "Layout", "Mode", "OnBusy", "PrepackWeights", "SchedulingOptions", "SessionStoreKwargs", "SessionStoreOptions",
    "StoreConfig", "StoreKwargs", "StoreOptions", "TokensOrSize", "Unpack", "check_known", "option",
    "split_engine_options",
]
