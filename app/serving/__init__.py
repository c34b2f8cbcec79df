"""Serving many visitors: the model jobs (Service), the server-side session store with its memory budget, and
streaming helpers."""

from app.serving.choice import Job, TurnSettings, prompt_for_protocol, unedited
from app.serving.service import DEFAULTS, Admitted, ChatChange, Service, TurnOpened
from app.serving.sessions import MB, Entry, SessionStore, StoreStats, kv_after, kv_reserve
from app.serving.streaming import closes_elsewhere, in_batches

__all__ = ["Service", "DEFAULTS", "Admitted", "ChatChange", "TurnOpened", "Job", "TurnSettings", "prompt_for_protocol",
           "unedited", "MB", "Entry", "SessionStore", "StoreStats", "kv_after", "kv_reserve", "closes_elsewhere",
           "in_batches"]
