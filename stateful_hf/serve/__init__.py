"""Serving: an OpenAI-compatible HTTP server over the engine (`python -m stateful_hf.serve`), and a
multi-replica cluster on Ray Serve with a session-aware router that migrates KV on hints.

Needs the `serve` extra (fastapi, uvicorn); the cluster needs the `ray` extra (ray[serve])."""

from .app import ServeConfig, create_app
from .local_client import LocalClient
from .migrate import SessionExport, export_session, import_session
from .protocol import APIError
from .replica import Replica
from .router import Router
from .server import EngineOptions, ServerThread, build_local, load_model

__all__ = [
    "APIError", "EngineOptions", "LocalClient", "Replica", "Router", "ServeConfig", "ServerThread", "SessionExport",
    "build_local", "create_app", "export_session", "import_session", "load_model",
]
