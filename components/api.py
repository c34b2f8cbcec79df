"""The programmatic API's handlers (/ask, /chat, /stats), on the same Service as the page: its engines, sessions and
KV budget. An error reaches the client as a short
message, never Gradio's generic one; the log keeps the traceback of anything that is not a user mistake."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import gradio as gr

from app.backends import BackendError
from app.episode import SegmentFinished, TextDelta
from app.serving import MB, Service, TurnOpened
from app.settings import InputError
from components.inputs import settings_from_dict
from components.page_state import PageStates

log = logging.getLogger(__name__)


def api_error(error: Exception, what: str) -> gr.Error:
    """The error an API client sees: a user mistake as is, anything else logged and named (not Gradio's generic
    "upstream app has raised an exception")."""
    if isinstance(error, BackendError):
        log.warning("%s failed: %s", what, error)
    if isinstance(error, (InputError, BackendError)):  # a user mistake or the model server's: no traceback
        return gr.Error(str(error), print_exception=False)
    log.exception("%s failed", what)  # logged here once; Gradio need not print it again
    return gr.Error(f"internal error ({type(error).__name__}: {error})", print_exception=False)


class Api:
    """/ask, /chat and /stats on the process's Service."""

    def __init__(self, service: Service, pages: PageStates):
        self.service, self.pages = service, pages

    def ask(self, question: str, settings: dict | None = None) -> dict:
        """Answer one question in a fresh session and return its episode (same schema as the CLI's JSON).
        `settings`, optional, is a JSON object of any of max_new_tokens, max_length, max_turns, max_tool_response,
        temperature, top_p, top_k, use_cache, seed, draft_tokens, guide (guided answers: true, or false, the default),
        protocol (auto, the default, textenv or chat),
        tools (a list of names) and prompt (a template with {tools}, {abilities}, {actions})."""
        try:
            return self.service.ask(question, settings_from_dict(settings)).to_json()
        except Exception as error:  # API boundary: the client gets the message, the log the traceback
            raise api_error(error, "/ask") from None

    def stats(self) -> dict:
        """The server's load, for monitoring: sessions, their KV against the budget, and how many rows the
        in-process scheduler batches into a step."""
        store = self.service.store.stats()
        backend = self.service.backend_stats()
        out = {"sessions": store.sessions, "kv_mb": round(store.kv_bytes / MB, 2),
               "shared_kv_mb": round(store.shared_bytes / MB, 2), "budget_mb": round(store.budget_bytes / MB, 2)}
        if backend is not None:
            out["model"] = {"backend": backend.name, "adapter": backend.adapter}
        if backend is not None and backend.steps is not None:
            out["scheduler"] = {"steps": backend.steps, "mean_rows": round(backend.rows / max(1, backend.steps), 2),
                                "peak_rows": backend.peak_rows}
        return out

    def chat(self, message: str, settings: dict | None = None, request: gr.Request = None) -> Iterator[str]:
        """Continue this API client's chat (one per client session); yields the growing text of the turn.
        `settings`, optional, is a JSON object of any of max_new_tokens, max_length, max_turns, max_tool_response,
        temperature, top_p, top_k, use_cache, seed, draft_tokens, guide (guided answers: true, or false, the default),
        protocol (auto, the default, textenv or chat),
        tools (a list of names) and prompt (a template with {tools}, {abilities}, {actions}). A change of tools or
        prompt starts a new chat."""
        try:
            asked = settings_from_dict(settings)
            key = request.session_hash
            entry = self.service.store.get(key)
            text = ""
            for update in self.service.stream_turn(key, message, asked, entry.chat_stop.begin(None)):
                if isinstance(update, TurnOpened):  # (as the page's chat: the notes say so)
                    self.pages.of(entry).chat_changed(update.change, update.job.engine.tools)
                    continue
                before = len(text)
                for event in update:
                    if isinstance(event, TextDelta):
                        text += event.text
                    elif isinstance(event, SegmentFinished) and event.segment.kind == "tool":
                        text += event.segment.text
                if len(text) > before:
                    yield text
        except Exception as error:  # API boundary: the client gets the message, the log the traceback
            raise api_error(error, "/chat") from None
