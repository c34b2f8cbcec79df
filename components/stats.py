"""Stats panel: this session's cache and the server's totals, as markdown."""

from __future__ import annotations

from app.engine import Session
from app.sessions import MB, StoreStats


def stats_markdown(session: Session | None, store: StoreStats) -> str:
    if session is None:
        mine = "This chat: no tokens yet"
    else:
        cache = session.cache
        mine = (f"This chat: {len(cache)} tokens, {cache.cached} cached "
                f"({cache.nbytes / MB:.1f} MB of KV), {len(session.episodes)} turns")
    server = (f"Server: {store.sessions} session{'s' if store.sessions != 1 else ''}, "
              f"{store.kv_bytes / MB:.1f} MB of KV + {store.shared_bytes / MB:.1f} MB of shared prompts "
              f"(budget {store.budget_bytes / MB:.0f} MB)")
    return f"{mine}  \n{server}"
