"""How an option is declared and checked: `option(default, help, ...)` is a dataclass field whose
metadata the command lines read (`stateful_hf/serve/flags.py`); `Options.build` makes an option
dataclass from keyword arguments, an unknown name raising TypeError with the closest valid ones; the
`check_*` functions are the checks the options' `__post_init__`s share (ValueError naming the option)."""

from __future__ import annotations

import difflib
import math
import numbers
import sys
from collections.abc import Collection, Iterable
from dataclasses import MISSING, field, fields
from typing import Annotated, Any

if sys.version_info >= (3, 11):
    from typing import Unpack
else:                                                   # Python 3.10
    from typing_extensions import Unpack

__all__ = ["TokensOrSize", "Unpack", "check_known", "option"]

CAPACITY = "capacity"
# An amount of KV: tokens (an int) or a size ("2GiB", "512MB"); parsed by `stateful_hf.cache.parse_capacity`.
TokensOrSize = Annotated[int | str, CAPACITY]


def option(default: Any = MISSING, help: str = "", *, flag: bool | tuple[str, ...] = False,
           metavar: str | None = None, cli: str | None = None) -> Any:
    """A field of an option dataclass: its `default` and a one-line `help`. `flag`: True, the option is
    a command-line flag `--name-with-dashes`; a tuple, those spellings. `metavar` and `cli` (the flag's
    help where the command line's wording differs from the API's) are the flag's."""
    return field(default=default, metadata={"help": help, "flag": flag, "metavar": metavar, "cli": cli})


class Options:
    """Base of the option dataclasses: `names()` and `build(**given)`."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def build(cls, **given: Any):
        """`cls(**given)`; an unknown name raises TypeError naming the closest valid ones."""
        check_known(given, cls.names())
        return cls(**given)


def check_known(given: Iterable[str], known: Collection[str]) -> None:
    """TypeError for the first name of `given` not in `known`: "unknown option 'host_capcity'; did you
    mean 'host_capacity'?" (difflib's closest names; all of them when none is close)."""
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
            if close:
                names = " or ".join(repr(c) for c in close) if len(close) < 3 else \
                    f"{', '.join(repr(c) for c in close[:-1])} or {close[-1]!r}"
                raise TypeError(f"unknown option {name!r}; did you mean {names}?")
            raise TypeError(f"unknown option {name!r}; the options are {', '.join(sorted(known))}")


def check_fraction(name: str, value: Any, unit: str = "") -> float:
    """A real number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1){unit}, got {value!r}")
    return value


def check_int(name: str, value: Any, least: int, *, none: str | None = None) -> int | None:
    """An int >= `least` (not a bool); None too when `none` says what None means."""
    if value is None and none is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be >= {least}" + (" or None" if none is not None else "") + f", got {value!r}")
    return value


def check_seconds(name: str, value: Any) -> float | None:
    """None or a positive finite number of seconds (as a float)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def check_capacity(name: str, value: Any, *, zero: bool = False) -> None:
    """Tokens (an int > 0, or >= 0 with `zero`) or a size string; whether the string parses is the
    store's check (`capacity_in_blocks`)."""
    if isinstance(value, str) and value.strip():
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"{name} must be tokens (an int > 0) or a size like '2GiB', got {value!r}")

