"""The options' modes as string enums. A member equals its string (`Layout.VIRTUAL == "virtual"`) and
callers may pass either: the options convert strings to members at construction (`Mode.of`), so the
code past them compares members (`layout is Layout.VIRTUAL`)."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:                                                   # Python 3.10: enum.StrEnum's behaviour
    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class Mode(StrEnum):
    """A mode of an option. Its repr is its string's, so messages read `layout='virtual'`."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def of(cls, name: str, value: object) -> Mode:
        """`value` (a member or its string) as a member; else ValueError naming option `name` and the modes."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be one of {', '.join(cls)}, got {value!r}") from None


class Layout(Mode):
    """How the device tier holds KV: a pool of blocks, or vAttention's per-session contiguous slots."""

    PAGED = "paged"
    VIRTUAL = "virtual"


class HiddenStates(Mode):
    """HCache: whether chunks moving down are kept as hidden states (`cache/hidden/`)."""

    AUTO = "auto"          # "always" where a layer's hidden state is smaller than its K+V (MHA), else "never"
    ALWAYS = "always"
    NEVER = "never"


class OnBusy(Mode):
    """What `Engine.submit` does for a session that has a turn in flight."""

    WAIT = "wait"
    REFUSE = "refuse"


class GenerationConfigMode(Mode):
    """Where a request's unset sampling fields come from (vLLM's `--generation-config`)."""

    AUTO = "auto"          # the model's generation config, then SamplingParams' defaults
    LIBRARY = "library"    # SamplingParams' defaults only


class PrepackWeights(Mode):
    """Whether the engine's steps multiply by packed copies of the linear weights (`kernels/linear.py`)."""

    AUTO = "auto"          # where this CPU has a packed kernel for the model's dtype
    ON = "on"              # always; an error where there is none
    OFF = "off"            # F.linear on the model's own weights
