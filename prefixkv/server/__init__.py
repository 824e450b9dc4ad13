"""Owns: the HTTP layer: a small core (app factory, errors, limits, metrics, admin, SSE writer).
Imports: prefixkv.engine; each dialect subpackage (openai/, anthropic/, sglang/) imports the core.

The HTTP layer: an OpenAI-compatible API, cache admin routes and Prometheus metrics.

``create_app(engine, api_key=None, model_name=...)`` builds the FastAPI app for a running
``AsyncEngine``; ``prefixkv serve`` (``prefixkv.cli.serve``) runs it under uvicorn.
The app is imported lazily so ``prefixkv --help`` does not pay for FastAPI and the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from prefixkv.server.app import create_app

        return create_app
    raise AttributeError(f"module 'prefixkv.server' has no attribute {name!r}")
