"""The programmatic API's handlers (/ask, /chat, /stats), on the same engines, sessions and KV budget as the page
(a mixin of components.handlers.ChatService, whose pieces they use). An error reaches the client as a short
message, never Gradio's generic one; the log keeps the traceback of anything that is not a user mistake."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import gradio as gr

from app.backends import BackendError
from app.engine import Engine
from app.episode import SegmentFinished, TextDelta
from app.serving import MB
from app.serving import in_batches
from app.settings import InputError, Settings, clean_question
from components.inputs import DEFAULTS, settings_from_dict

if TYPE_CHECKING:
    from app.serving import SessionStore

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


class ApiHandlers:
    """/ask, /chat and /stats, for ChatService."""

    store: SessionStore

    def api_settings(self, settings: dict | None) -> tuple[Engine, Settings, str | None]:
        """The engine, the checked settings and the prompt template an API call's `settings` dict asks for."""
        values, tools, prompt = settings_from_dict(settings)
        engine = self.engine_for(tools, values.protocol)
        return engine, values.validated(engine.context_limit, DEFAULTS.max_length), prompt

    def api_ask(self, question: str, settings: dict | None = None) -> dict:
        """Answer one question in a fresh session and return its episode (same schema as the CLI's JSON).
        `settings`, optional, is a JSON object of any of max_new_tokens, max_length, max_turns, max_tool_response,
        temperature, top_p, top_k, use_cache, seed, draft_tokens, guide (guided answers: true, the default, or false),
        protocol (auto, the default, textenv or chat),
        tools (a list of names) and prompt (a template with {tools}, {abilities}, {actions})."""
        try:
            engine, values, prompt = self.api_settings(settings)
            session = engine.new_session(prompt, use_cache=values.use_cache, seed=values.seed)
            with self.job_slot(session, use_cache=values.use_cache):
                return engine.ask(session, question, values).to_json()
        except Exception as error:  # API boundary: the client gets the message, the log the traceback
            raise api_error(error, "/ask") from None

    def api_stats(self) -> dict:
        """The server's load, for monitoring: sessions, their KV against the budget, and how many rows the
        in-process scheduler batches into a step."""
        store = self.store.stats(self.shared_kv_bytes())
        backend = self.backend_stats()
        out = {"sessions": store.sessions, "kv_mb": round(store.kv_bytes / MB, 2),
               "shared_kv_mb": round(store.shared_bytes / MB, 2), "budget_mb": round(store.budget_bytes / MB, 2)}
        if backend is not None and backend.steps is not None:
            out["scheduler"] = {"steps": backend.steps, "mean_rows": round(backend.rows / max(1, backend.steps), 2),
                                "peak_rows": backend.peak_rows}
        return out

    def api_chat(self, message: str, settings: dict | None = None, request: gr.Request = None) -> Iterator[str]:
        """Continue this API client's chat (one per client session); yields the growing text of the turn.
        `settings`, optional, is a JSON object of any of max_new_tokens, max_length, max_turns, max_tool_response,
        temperature, top_p, top_k, use_cache, seed, draft_tokens, guide (guided answers: true, the default, or false),
        protocol (auto, the default, textenv or chat),
        tools (a list of names) and prompt (a template with {tools}, {abilities}, {actions}). A change of tools or
        prompt starts a new chat."""
        try:
            engine, values, prompt = self.api_settings(settings)
            message = clean_question(message)  # before prepare: a rejected message must not start a new chat
            entry = self.store.get(request.session_hash)
            session, change = self.prepare(entry, engine, values, prompt, message)
            self.page_of(entry).chat_changed(change, engine.tools)  # (as the page's chat: the notes say so)
            text = ""
            cancel = entry.chat_stop.begin(None)
            with self.chat_slot(session, values.use_cache, cancel):
                for events in in_batches(engine.turn(session, message, values, cancel=cancel), cancel):
                    before = len(text)
                    for event in events:
                        if isinstance(event, TextDelta):
                            text += event.text
                        elif isinstance(event, SegmentFinished) and event.segment.kind == "tool":
                            text += event.segment.text
                    if len(text) > before:
                        yield text
            self.store.enforce_budget(self.shared_kv_bytes())
        except Exception as error:  # API boundary: the client gets the message, the log the traceback
            raise api_error(error, "/chat") from None
