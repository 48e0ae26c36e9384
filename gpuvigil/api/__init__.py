"""Scheduler feedback API: the SQLite hint/finding store and the FastAPI app that serves it."""

from gpuvigil.api.store import HintState, HintStore

__all__ = ["HintState", "HintStore", "create_app", "serve_api_in_thread"]


def __getattr__(name: str):
    # The app pulls in FastAPI/uvicorn; keep `from gpuvigil.api import HintStore` light.
    if name in ("create_app", "serve_api_in_thread"):
        from gpuvigil.api import app

        return getattr(app, name)
    raise AttributeError(name)
