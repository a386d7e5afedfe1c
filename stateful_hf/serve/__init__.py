"""Serving: an OpenAI-compatible HTTP server over the engine (`python -m stateful_hf.serve`), and a
multi-replica cluster on Ray Serve with a session-aware router that migrates KV on hints.

Needs the `serve` extra (fastapi, uvicorn); the cluster needs the `ray` extra (ray[serve]). The names
below load on first use (PEP 562), so the command line (`__main__.py`, `flags.py`) checks its flags
before torch, transformers or the web stack are imported."""

from __future__ import annotations

from ..lazy import lazy_exports

__all__ = [
    "APIError", "EngineOptions", "LocalClient", "Replica", "Router", "ServeConfig", "ServerThread", "SessionExport",
    "build_local", "create_app", "export_session", "import_session", "load_model",
]


def _facade() -> dict:
    """The public names, imported."""
    from .app import ServeConfig, create_app
    from .local_client import LocalClient
    from .migrate import SessionExport, export_session, import_session
    from .protocol import APIError
    from .replica import Replica
    from .router import Router
    from .server import EngineOptions, ServerThread, build_local, load_model
    return {"APIError": APIError, "EngineOptions": EngineOptions, "LocalClient": LocalClient, "Replica": Replica,
            "Router": Router, "ServeConfig": ServeConfig, "ServerThread": ServerThread, "SessionExport": SessionExport,
            "build_local": build_local, "create_app": create_app, "export_session": export_session,
            "import_session": import_session, "load_model": load_model}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _facade)
