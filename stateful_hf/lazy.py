"""Public names of a package that load on first use (PEP 562), so importing the package stays light:
`stateful_hf` and `stateful_hf.serve` import neither torch nor transformers until a name is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, namespace: dict, load: Callable[[], dict]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`, whose module dict is `namespace`. The first use of a
    name in its `__all__` binds every name `load()` returns (its imports run together, side effects
    included); any other name resolves to a submodule not imported yet."""

    def __getattr__(name: str):
        if name in namespace["__all__"]:
            namespace.update(load())
            return namespace[name]
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace["__all__"]})

    return __getattr__, __dir__
