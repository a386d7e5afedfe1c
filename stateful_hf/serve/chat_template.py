"""`--chat-template PATH`: the one place a chat template file is read and put on a tokenizer, for the
server (`__main__.py`) and the demo.

`read_chat_template` needs neither torch nor transformers, so the command lines check the file before
the heavy imports; `load_chat_template` reads it and makes it the tokenizer's template, checked by
rendering a one-message chat (`stateful_hf.models.use_chat_template`). The Ray ingress (`cluster.py`) is
given the text read here, through `models.use_chat_template`. A template that renders
tools (`apply_chat_template(tools=...)`) is given the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


def read_chat_template(path: str | os.PathLike) -> str:
    """The text of the Jinja file `path`; ValueError saying why not (missing, unreadable, not UTF-8, empty)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(str(e)) from None
    if not text.strip():
        raise ValueError("the file is empty")
    return text


def load_chat_template(path: str | os.PathLike | None, tokenizer) -> str | None:
    """Make the Jinja file `path` the tokenizer's chat template and return its text; None (the
    tokenizer's own template kept) when `path` is None. ValueError saying why not, the tokenizer
    unchanged: the file cannot be read, or its template does not render a one-message chat."""
    if path is None:
        return None
    from ..models import use_chat_template
    text = read_chat_template(path)
    use_chat_template(tokenizer, text)
    return text
