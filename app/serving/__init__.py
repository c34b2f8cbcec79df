"""Serving many visitors: the server-side session store with its memory budget, and streaming helpers."""

from app.serving.sessions import MB, Entry, SessionStore, StoreStats, kv_after, kv_reserve
from app.serving.service import ChatChange, Service
from app.serving.streaming import closes_elsewhere, in_batches

__all__ = ["Service", "ChatChange", "MB", "Entry", "SessionStore", "StoreStats", "kv_after", "kv_reserve",
           "closes_elsewhere", "in_batches"]
