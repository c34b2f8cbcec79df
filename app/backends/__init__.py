"""What runs the model: the Backend interface, and the choice between the model in this process and a model
server (select)."""

from app.backends.base import Backend, BackendError, BackendStats, SegmentRequest, SegmentStream
from app.backends.select import concurrent_turns, load_backend

__all__ = ["Backend", "BackendError", "BackendStats", "SegmentRequest", "SegmentStream", "concurrent_turns",
           "load_backend"]
