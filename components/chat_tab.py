"""The Chat tab's events on the process's Service: a turn streamed into the chat, Compare, Stop, New chat, the page's
load. Each visitor's page state (components/page_state.py) sits beside their serving entry; the chat itself,
its KV cache and every model job belong to serving (app/serving). Handlers return typed updates (ChatView,
CompareView): a field left None leaves its component as it is (components/wiring.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import gradio as gr

from app.engine import Session
from app.episode import Episode, SegmentFinished, SegmentStarted, TextDelta
from app.serving import Entry, Service, TurnOpened, unedited
from app.settings import InputError
from components.chat import chat_messages, ending_note, waiting_messages
from components.compare import compare_markdown, guide_markdown
from components.inputs import DEFAULTS, PageSettings, max_length_for, page_protocol
from components.page_state import PageState, PageStates
from components.stats import stats_markdown
from components.status import done_status, failure_status, finished_marker
from components.timing import prefill_frame, segment_order, time_frame, timing_summary
from components.tokens import guided_spans, token_spans

MAX_UNANSWERED = 3  # a visitor's messages sent and not yet answered (the running one too): more stay in the box


@dataclass(frozen=True)
class ChatView:
    """One update of the Chat tab's turn outputs; None: unchanged."""

    chat: list | None = None
    msg: str | None = None  # the message box
    status: str | None = None
    tokens: list | None = None
    stats: str | None = None
    turn_marker: str | None = None  # the completion marker (components.status.finished_marker), with a final status
    timing: Any = None  # the charts, with a turn's final status
    timing_ms: Any = None
    timing_text: str | None = None


@dataclass(frozen=True)
class CompareView:
    """One update of Compare's outputs; None: unchanged."""

    compare_result: str | None = None
    status: str | None = None
    turn_marker: str | None = None


class ChatTab:
    """The Chat tab's handlers over one Service, with every visitor's page state."""

    def __init__(self, service: Service, pages: PageStates):
        self.service, self.pages = service, pages

    def page_of(self, key: str) -> tuple[Entry, PageState]:
        """The visitor's serving entry (created when missing) and page state (kept as long as the entry)."""
        entry = self.service.store.get(key)
        return entry, self.pages.of(entry)

    def token_view(self, session: Session | None) -> list[tuple[str, str]]:
        if session is None:
            return []
        segments = [s for episode in session.episodes for s in episode.segments]
        return token_spans(session.cache.ids, guided_spans(session.spans(), segments), self.service.decode)

    def stats(self, session: Session | None) -> str:
        return stats_markdown(session, self.service.store.stats(), self.service.backend_stats())

    # ---- a turn -----------------------------------------------------------------------------------------------
    def submit(self, message: str, chat: list | None, request: gr.Request) -> tuple[str, dict, list]:
        """Runs unqueued the moment the page sends a message: empties the box at once (what the visitor types
        next is kept, even while this turn waits), shows the message in the chat as waiting, and hands the turn
        its message and Stop ticket. A visitor with MAX_UNANSWERED messages unanswered keeps this one in the box:
        each waiting turn holds one of the model's shared places while it waits for the visitor's running one,
        so one visitor could otherwise hold them all."""
        entry, state = self.page_of(request.session_hash)
        message = message or ""
        unanswered = state.unanswered_besides()
        if message.strip() and unanswered >= MAX_UNANSWERED:
            return message, {"refused": unanswered}, gr.skip()
        ticket = entry.chat_stop.ticket()
        submitted = {"message": message, "ticket": ticket, "sent": state.send(message)}  # (the box empties)
        if not message.strip():
            return "", submitted, gr.skip()
        return "", submitted, [*(chat or []), *waiting_messages(message)]

    def turn(self, submitted: dict | None, settings: PageSettings, request: gr.Request) -> Iterator[ChatView]:
        """The turn submit() handed over (its message, Stop ticket and number among the waiting messages), streamed
        into the chat, one turn of this visitor's at a time; the final update carries the status (done, stopped or
        the error), the token view, the stats, the charts and the completion marker, once per turn."""
        submitted = submitted or {}
        if "refused" in submitted:  # (kept in the box by submit; no place taken, no wait for the running turn)
            gr.Warning(f"not sent: {submitted['refused']} messages are waiting for their answers; send this one "
                       "when one is answered")
            return
        key = request.session_hash
        entry, state = self.page_of(key)
        with state.turn_order:  # (a turn of this visitor's that is still running ends first)
            yield from self._turn(key, entry, state, submitted, settings)

    def _turn(self, key: str, entry: Entry, state: PageState, submitted: dict,
              settings: PageSettings) -> Iterator[ChatView]:
        message, sent = submitted.get("message") or "", submitted.get("sent")
        cancel = entry.chat_stop.begin(submitted.get("ticket"))

        def view(status: str, msg: str | None = None, partial: str | None = None, full: bool = False,
                 final: bool = False) -> ChatView:
            """One update; `full`: with the token view and the stats (a segment ended); `final`: the turn's last,
            with the charts too and, last of all, the bump of the visitor's count of finished work that its marker
            carries."""
            current = entry.session
            episodes = current.episodes if current else []
            chat = chat_messages(episodes, state.notes, partial, state.waiting_messages())
            shown = ChatView(chat, msg, status)
            if full or final:
                shown = replace(shown, tokens=self.token_view(current), stats=self.stats(current))
            if final:
                shown = replace(shown, **self.chart_fields(episodes),
                                turn_marker=finished_marker(state.chat_finished.bump()))
            return shown

        if cancel.is_set():  # Stop was pressed while this message waited in the queue: it is not sent, and goes
            # back to the box with every other message the same Stop kept from being sent
            unsent = state.not_sent(sent, message)
            status = "the message was not sent" if len(unsent) == 1 else f"{len(unsent)} messages were not sent"
            yield view(f"stopped: {status}", msg="\n".join(unsent), final=True)
            return
        try:
            yield view("running")  # (in the try: a stream closed here still lets go of its message)
            session, protocol, partial = None, None, None
            for update in self.service.stream_turn(key, message, settings.asked(), cancel):
                if isinstance(update, TurnOpened):
                    session, protocol = update.session, update.job.protocol
                    state.chat_changed(update.change, update.job.engine.tools)
                    continue
                state.started(sent)  # the episode shows it from now on
                full = False
                for event in update:
                    if isinstance(event, SegmentStarted):
                        partial = "" if event.kind == "model" else None
                    elif isinstance(event, TextDelta):
                        partial = (partial or "") + event.text
                    elif isinstance(event, SegmentFinished):
                        partial, full = None, True
                yield view("running", partial=partial, full=full)
            if entry.session is not session:
                yield view("new chat", final=True)
                return
            ended = ending_note(session.episodes[-1] if session.episodes else None)
            yield view(done_status(state.unanswered_besides(sent), len(state.comparing), ended=ended,
                                   protocol=protocol), final=True)
        except Exception as error:  # handler boundary: show it (and log the unexpected), keep session and server
            state.started(sent)
            yield view(failure_status(error, "turn", key), msg=message, final=True)
        finally:
            state.answered(sent)

    @staticmethod
    def chart_fields(episodes: list[Episode]) -> dict:
        """The timing view as ChatView fields: charts of prefill tokens (new vs reused) and ms per segment, and a
        one-line summary of the last turn."""
        tokens, ms = prefill_frame(episodes), time_frame(episodes)
        if not episodes:  # (no `sort`: a change of it redraws the chart from its previous data, which would keep
            # the last chat's bars after New chat; the data alone clears them)
            return dict(timing=gr.BarPlot(value=tokens), timing_ms=gr.BarPlot(value=ms),
                        timing_text=timing_summary(episodes))
        order = segment_order(tokens)
        return dict(timing=gr.BarPlot(value=tokens, sort=order), timing_ms=gr.BarPlot(value=ms, sort=order),
                    timing_text=timing_summary(episodes))

    # ---- Compare ------------------------------------------------------------------------------------------------
    def ticket(self, request: gr.Request) -> int:
        """A Stop ticket for the Chat tab's work (turns, Compare), taken when the page submits it."""
        return self.page_of(request.session_hash)[0].chat_stop.ticket()

    def compare(self, msg: str, settings: PageSettings, request: gr.Request, what: str = "cache",
                ticket: int | None = None) -> Iterator[CompareView]:
        """The question with the cache (`what` "cache") or the guide ("guide": what the guide chose, and what the
        model writes alone) on and off, on forks of the visitor's chat, which stays as it was; an empty box: the
        chat's last turn again, from where it was asked."""
        key = request.session_hash
        entry, state = self.page_of(key)
        cancel, mine = entry.chat_stop.begin(ticket), state.compare_started()
        try:
            yield CompareView(status=f"running: compare ({what} on, then off)")
            result, job = self.service.compare(key, what, msg or "", settings.asked(), cancel)
            state.compare_ended(mine)
            shown = compare_markdown(result) if what == "cache" else guide_markdown(result)
            status = done_status(state.unanswered_besides(), len(state.comparing), result.stopped,
                                 protocol=job.protocol)
            yield CompareView(shown, status, finished_marker(state.chat_finished.bump()))
        except Exception as error:  # handler boundary
            status = failure_status(error, "compare", key)
            yield CompareView(status=status, turn_marker=finished_marker(state.chat_finished.bump()))
        finally:
            state.compare_ended(mine)

    def compare_guide(self, msg: str, settings: PageSettings, request: gr.Request,
                      ticket: int | None = None) -> Iterator[CompareView]:
        """compare() with the guide on and off (the cache as set)."""
        yield from self.compare(msg, settings, request, "guide", ticket)

    # ---- the chat's other events ------------------------------------------------------------------------------
    def stop(self, request: gr.Request) -> None:
        """The Chat tab's Stop: the running turn or Compare, and every one submitted before it."""
        self.service.store.cancel(request.session_hash)

    def new_chat(self, request: gr.Request) -> ChatView:
        """An empty chat, but for messages already sent and waiting (they are answered in the new chat, so they
        show there at once); the box keeps what is typed."""
        entry = self.service.store.reset(request.session_hash)
        state = self.pages.of(entry)
        state.new_chat()
        return ChatView(chat_messages([], waiting=state.waiting_messages()), status="new chat", tokens=[],
                        stats=self.stats(entry.session), **self.chart_fields([]))

    def refresh(self, request: gr.Request) -> ChatView:
        """Page load: a new page (a reload too) is a new Gradio session, so this shows an empty chat, the
        server's stats and the charts, and registers the visitor; closing the page frees the session."""
        entry, state = self.page_of(request.session_hash)
        session = entry.session
        episodes = session.episodes if session else []
        return ChatView(chat_messages(episodes, state.notes), tokens=self.token_view(session),
                        stats=self.stats(session), **self.chart_fields(episodes))

    def unload(self, request: gr.Request) -> None:
        self.service.store.remove(request.session_hash)


@dataclass(frozen=True)
class SettingsView:
    """Updates of the settings fields; None: unchanged."""

    max_length: Any = None
    prompt: str | None = None


class SettingsPanel:
    """The settings fields that follow the model and the protocol."""

    def __init__(self, service: Service):
        self.service = service

    def on_load(self, request: gr.Request) -> SettingsView:
        """Page load: the max_length field fitted to the backend and the prompt box on the default protocol's
        template; before the backend has loaded (never loaded here), the fields as built."""
        return SettingsView(self.max_length_field(), self.prompt_field())

    def prompt_field(self) -> str | None:
        """The default template of the protocol the selector starts on (what `auto` resolves to for this model);
        None before the backend has loaded, or where that protocol cannot run on it (the turn says why)."""
        if self.service.loaded_backend() is None:
            return None
        try:
            return self.service.engine_for(None, page_protocol()).protocol.default_template()
        except InputError:
            return None

    def max_length_field(self) -> gr.Number | None:
        """For a backend whose context is shorter than the page's default: that context, and why; else None (a
        turn sent with the page's default gets the backend's, make_settings)."""
        backend = self.service.loaded_backend()
        if backend is None or max_length_for(backend.context_limit) == DEFAULTS.max_length:
            return None
        return gr.Number(value=max_length_for(backend.context_limit),
                         info=f"at most {backend.context_limit:,} tokens here (the model's context)")

    def protocol_prompt(self, protocol: str | None, prompt: str | None, request: gr.Request) -> SettingsView:
        """The Protocol selector changed: a box holding a protocol's default template (unedited) shows the default
        of the protocol now selected (`auto`: what it resolves to for this model); an edited prompt stays."""
        try:
            if not unedited(prompt, self.service.default_templates()):
                return SettingsView()
            return SettingsView(prompt=self.service.engine_for(None, protocol).protocol.default_template())
        except Exception as error:  # handler boundary: the box stays as it was, the visitor sees why
            failure_status(error, "protocol", request.session_hash)
            return SettingsView()
