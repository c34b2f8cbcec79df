"""The process's engines: one per protocol and tool set over the one backend, built once, and the prefilled prompts
they share with the sessions, which the session store counts against its budget and frees when it must."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from app.backends.base import Backend
from app.engine.engine import Engine
from app.model.kvcache import kv_nbytes
from app.protocols import resolve
from app.settings import InputError, default_protocol
from app.tools.registry import default_tools, get_tools


class Engines:
    """Engines by Engine.key (protocol and tool set); the SessionStore's SharedPrompts."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, ...], Engine] = {}
        self._lock = threading.Lock()

    def get(self, backend: Backend, tools: Sequence[str] | None, protocol: str | None = None) -> Engine:
        """The engine for a tool subset (None: every tool; names case-insensitive) and protocol (None: the default),
        or a clear InputError."""
        available = default_tools()
        try:
            chosen = get_tools(tools)
        except ValueError as error:
            raise InputError(str(error)) from None
        names = tuple(name for name in available if name in chosen)  # registry order: one engine per subset
        try:
            with backend.lock:
                chosen_protocol = resolve(protocol or default_protocol(), backend.tokenizer, backend.tuned_for)
        except ValueError as error:
            raise InputError(str(error)) from None
        key = (chosen_protocol, *names)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                engine = Engine(backend, tools={n: available[n] for n in names}, protocol=chosen_protocol)
                self._engines[key] = engine
            return engine

    def kv_bytes(self, read: Sequence[object]) -> int:
        """KV of the prompts the engines hold prefilled and of those the sessions `read` (some an engine has let
        go of), each counted once."""
        with self._lock:
            engines = list(self._engines.values())
        held = {id(kv): kv for engine in engines for kv in engine.shared_kv()}
        held.update((id(kv), kv) for kv in read)
        return sum(kv_nbytes(kv) for kv in held.values())

    def release(self, read: Sequence[object]) -> int:
        """Every engine lets go of the prompts no session reads; the bytes freed."""
        before = self.kv_bytes(read)
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            engine.release_prompts({id(kv) for kv in read})
        return before - self.kv_bytes(read)
