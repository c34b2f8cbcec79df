"""Which backend answers: the only module that knows both. A model server where MODEL_SERVER_URL is set, else the
model loaded in this process."""

from __future__ import annotations

import os

from app.backends.base import Backend, BackendError


def load_backend() -> Backend:
    """The backend the environment asks for: a model server when MODEL_SERVER_URL is set, else the model loaded
    in this process (MODEL_ID / GGUF_FILE, default the bundled GGUF, else the same model from the hub). A model
    that cannot be had here is a BackendError: one line for the page, the API and the CLI."""
    from app.model.loading import ModelUnavailable

    try:
        return _load_backend()
    except ModelUnavailable as error:
        raise BackendError(str(error)) from error


def _load_backend() -> Backend:
    url = os.environ.get("MODEL_SERVER_URL", "").strip()
    if url:
        from app.backends.server import ServerBackend

        return ServerBackend.from_env(url)
    from app.backends.local import LocalBackend
    from app.model.loading import load_model

    return LocalBackend(load_model())


def concurrent_turns() -> int:
    """How many turns the app runs at once. In process: as many rows as the scheduler batches into one step
    (app.backends.scheduler.MAX_ROWS). With a model server: server_parallel(), since the server batches them."""
    if os.environ.get("MODEL_SERVER_URL", "").strip():
        from app.backends.server import server_parallel

        return server_parallel()
    from app.backends.scheduler import MAX_ROWS

    return MAX_ROWS
