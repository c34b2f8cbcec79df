"""Stats panel: which backend answers, this session's cache and the server's totals, as markdown."""

from __future__ import annotations

from app.backends import BackendStats
from app.engine import Session
from app.serving import MB, StoreStats


def stats_markdown(session: Session | None, store: StoreStats, backend: BackendStats | None = None) -> str:
    """`backend`: None before the model is loaded. Where the keys/values live on a model server, this process holds
    none and the per-chat KV figures would say nothing."""
    if session is None:
        mine = "This chat: no tokens yet"
    elif backend is not None and not backend.kv_in_process:
        mine = (f"This chat: {len(session.cache)} tokens (their keys/values live on the model server), "
                f"{counted(len(session.episodes), 'turn')}")
    else:
        cache = session.cache
        shared = f", {cache.shared} read from the shared prompt" if cache.shared else ""
        mine = (f"This chat: {len(cache)} tokens, {cache.cached} cached "
                f"({cache.nbytes / MB:.1f} MB of KV of its own{shared}), {counted(len(session.episodes), 'turn')}")
    server = (f"Server: {counted(store.sessions, 'session')}, "
              f"{store.kv_bytes / MB:.1f} MB of KV + {store.shared_bytes / MB:.1f} MB of shared prompts "
              f"(budget {store.budget_bytes / MB:.0f} MB)")
    model = f"Model: {backend.name}" + (f" · {backend.runs}" if backend.runs else "") + "  \n" if backend else ""
    if backend and backend.adapter:
        model += f"Weights: base + LoRA adapter {backend.adapter} (ADAPTER=off runs the base model)  \n"
    return f"{model}{mine}  \n{server}"


def counted(n: int, noun: str) -> str:
    """A count with its noun: "1 turn", "2 turns", "0 sessions"."""
    return f"{n} {noun}{'s' if n != 1 else ''}"
