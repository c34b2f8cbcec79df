"""The page's event handlers: ChatService adds them to the process's shared serving pieces (app.serving.Service).
The page's Gradio session hash keys the server-side SessionStore; no user state lives in globals or in gr.State
(KV tensors would be deep-copied per visitor and kept an hour).
"""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from app.engine import Engine, Session, compare, compare_guide
from app.episode import SegmentFinished, SegmentStarted, TextDelta
from app.serving import Entry, Service, in_batches
from app.settings import PROTOCOLS, InputError, Settings, clean_question
from components.api import ApiHandlers
from components.batch_tab import BatchTab
from components.chat import chat_messages, ending_note, waiting_messages
from components.compare import compare_markdown, guide_markdown
from components.inputs import (DEFAULTS, PageSettings, max_length_for, page_protocol, prompt_for_protocol,
                               unedited)
from components.page_state import PageState, PageStates
from components.stats import stats_markdown
from components.status import done_status, failure_status, finished_marker
from components.timing import prefill_frame, segment_order, time_frame, timing_summary
from components.tokens import guided_spans, token_spans

MAX_UNANSWERED = 3  # a visitor's messages sent and not yet answered (the running one too): more stay in the box


class ChatService(Service, ApiHandlers, BatchTab):
    """The page's events on the process's shared pieces (app.serving.Service), with each visitor's page state
    (components/page_state.py) beside their serving entry."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pages = PageStates()

    def page_of(self, entry: Entry) -> PageState:
        """The visitor's page state, kept as long as their entry."""
        return self.pages.of(entry)

    def page_state(self, key: str) -> PageState | None:
        """The page state of the visitor `key`, if they have one (nothing is created or marked used)."""
        return self.pages.peek(self.store.peek(key))

    def warm_up(self) -> None:
        """Service.warm_up with the page's defaults."""
        super().warm_up(DEFAULTS)

    def token_view(self, session: Session | None) -> list[tuple[str, str]]:
        if session is None:
            return []
        segments = [s for episode in session.episodes for s in episode.segments]
        return token_spans(session.cache.ids, guided_spans(session.spans(), segments), self.decode)

    def stats(self, session: Session | None) -> str:
        return stats_markdown(session, self.store.stats(self.shared_kv_bytes()), self.backend_stats())


    # ---- page events ----------------------------------------------------------------------------------------
    def page_settings(self, page: PageSettings) -> tuple[Engine, Settings]:
        """The engine for the checked tools and the selected protocol, and the page's settings, checked against its
        model."""
        settings = page.settings()
        engine = self.engine_for(page.tool_list(), settings.protocol)
        return engine, settings.validated(engine.context_limit, DEFAULTS.max_length)

    def default_templates(self) -> list[str]:
        """Every protocol's default prompt template (Protocol.default_template) that this model can run."""
        templates = []
        for name in PROTOCOLS:
            if name == "auto":
                continue
            try:
                templates.append(self.engine_for(None, name).protocol.default_template())
            except InputError:  # (a protocol this model's tokenizer cannot follow)
                continue
        return templates

    def _page_prompt(self, engine: Engine, page: PageSettings) -> str:
        """The box's prompt template for `engine`'s protocol, or a clear InputError (empty, too long): another
        protocol's default, unedited, is this protocol's default (components.inputs.prompt_for_protocol)."""
        return prompt_for_protocol(page.prompt_template(), engine.protocol.default_template(),
                                   self.default_templates())

    def protocol_prompt(self, protocol: str | None, prompt: str | None, request: gr.Request):
        """The Protocol selector changed: a box holding a protocol's default template (unedited) shows the default
        of the protocol now selected (`auto`: what it resolves to for this model); an edited prompt stays."""
        try:
            defaults = self.default_templates()
            if not unedited(prompt, defaults):
                return gr.skip()
            return self.engine_for(None, protocol).protocol.default_template()
        except Exception as error:  # handler boundary: the box stays as it was, the visitor sees why
            failure_status(error, "protocol", request.session_hash)
            return gr.skip()

    def chat(self, message: str, use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt,
             request: gr.Request, seed=0, ticket: int | None = None, sent: int | None = None,
             guide: bool | None = None, protocol: str | None = None) -> Iterator[tuple]:
        """One turn from the page, streamed: (chat, textbox, status, tokens, stats, marker) per yield; the marker
        (finished_marker) comes with the final status only, once per turn, whatever ended it. `seed`: where a new
        chat's sampling starts; `ticket`: the Stop ticket taken when the page submitted it, `sent`: its number
        among the waiting messages (submit); `guide`: the Guided answers checkbox (None: the default); `protocol`:
        the Protocol selector (auto, textenv or chat; None: the default). (The page's inputs come in the
        parameters' order, `request` apart.)"""
        page = PageSettings(use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt, seed, guide,
                            protocol)
        yield from self._turn(message, page, request, ticket, sent)

    def _turn(self, message: str, page: PageSettings, request: gr.Request, ticket: int | None,
              sent: int | None) -> Iterator[tuple]:
        """chat() on the page's settings, one turn of this visitor's at a time."""
        key = request.session_hash
        entry = self.store.get(key)
        state = self.page_of(entry)
        with state.turn_order:  # (a turn of this visitor's that is still running ends first)
            yield from self._chat(entry, state, key, message or "", ticket, sent, page)

    def _chat(self, entry: Entry, state: PageState, key: str, message: str, ticket: int | None, sent: int | None,
              page: PageSettings) -> Iterator[tuple]:
        cancel = entry.chat_stop.begin(ticket)

        def view(status, textbox=None, partial=None, full=False, final=False):
            """One update; `final`: the turn's last, which bumps the visitor's count of finished work (last, once
            everything else in it is ready) and carries the completion marker."""
            current = entry.session
            textbox = gr.skip() if textbox is None else textbox
            chat = chat_messages(current.episodes if current else [], state.notes, partial, state.waiting_messages())
            tokens, stats = (self.token_view(current), self.stats(current)) if full else (gr.skip(), gr.skip())
            marker = finished_marker(state.chat_finished.bump()) if final else gr.skip()
            return chat, textbox, status, tokens, stats, marker

        if cancel.is_set():  # Stop was pressed while this message waited in the queue: it is not sent, and goes
            # back to the box with every other message the same Stop kept from being sent
            unsent = state.not_sent(sent, message)
            status = "the message was not sent" if len(unsent) == 1 else f"{len(unsent)} messages were not sent"
            yield view(f"stopped: {status}", textbox="\n".join(unsent), final=True)
            return
        try:
            yield view("running")  # (in the try: a stream closed here still lets go of its message)
            engine, settings = self.page_settings(page)
            question = clean_question(message)  # before prepare: a rejected message must not start a new chat
            session, change = self.prepare(entry, engine, settings, self._page_prompt(engine, page), question)
            state.chat_changed(change, engine.tools)
            partial: str | None = None
            with self.chat_slot(session, settings.use_cache, cancel):  # (it waits while running jobs fill the budget)
                # (the turn runs at the model's pace; each update shows everything that arrived since the last)
                for events in in_batches(engine.turn(session, message, settings, cancel=cancel), cancel):
                    state.started(sent)  # the episode shows it from now on
                    if entry.session is not session:  # new chat (or page closed) while this turn ran
                        break
                    full = False
                    for event in events:
                        if isinstance(event, SegmentStarted):
                            partial = "" if event.kind == "model" else None
                        elif isinstance(event, TextDelta):
                            partial = (partial or "") + event.text
                        elif isinstance(event, SegmentFinished):
                            partial, full = None, True
                    yield view("running", partial=partial, full=full)
            self.store.enforce_budget(self.shared_kv_bytes())
            others = state.unanswered_besides(sent)
            ended = ending_note(session.episodes[-1] if session.episodes else None)
            yield view(done_status(others, len(state.comparing), ended=ended, protocol=engine.protocol.name)
                       if entry.session is session
                       else "new chat", full=True, final=True)
        except Exception as error:  # handler boundary: show it (and log the unexpected), keep session and server
            state.started(sent)
            yield view(failure_status(error, "turn", key), textbox=message, full=True, final=True)
        finally:
            state.answered(sent)

    def timing(self, request: gr.Request) -> tuple:
        """The timing view of this visitor's chat: charts of prefill tokens (new vs reused) and ms per segment,
        and a one-line summary of the last turn."""
        entry = self.store.peek(request.session_hash)
        episodes = entry.session.episodes if entry is not None and entry.session is not None else []
        tokens, ms = prefill_frame(episodes), time_frame(episodes)
        if not episodes:  # (no `sort`: a change of it redraws the chart from its previous data, which would keep
            # the last chat's bars after New chat; the data alone clears them)
            return gr.BarPlot(value=tokens), gr.BarPlot(value=ms), timing_summary(episodes)
        order = segment_order(tokens)
        return gr.BarPlot(value=tokens, sort=order), gr.BarPlot(value=ms, sort=order), timing_summary(episodes)

    def submit(self, message: str, chat: list | None, request: gr.Request) -> tuple[str, dict, list]:
        """Runs unqueued the moment the page sends a message: empties the box at once (what the visitor types
        next is kept, even while this turn waits), shows the message in the chat as waiting, and hands the turn
        its message and Stop ticket. A visitor with MAX_UNANSWERED messages unanswered keeps this one in the box:
        each waiting turn holds one of the model's shared places while it waits for the visitor's running one,
        so one visitor could otherwise hold them all."""
        entry, message = self.store.get(request.session_hash), message or ""
        state = self.page_of(entry)
        unanswered = state.unanswered_besides()
        if message.strip() and unanswered >= MAX_UNANSWERED:
            return message, {"refused": unanswered}, gr.skip()
        ticket = entry.chat_stop.ticket()
        submitted = {"message": message, "ticket": ticket, "sent": state.send(message)}  # (the box empties)
        if not message.strip():
            return "", submitted, gr.skip()
        return "", submitted, [*(chat or []), *waiting_messages(message)]

    def ticket(self, request: gr.Request) -> int:
        """A Stop ticket for the Chat tab's work (turns, Compare), taken when the page submits it."""
        return self.store.get(request.session_hash).chat_stop.ticket()

    def chat_page(self, submitted: dict | None, use_cache, max_length, max_new_tokens, max_turns, temperature,
                  tools, prompt, request: gr.Request, seed=0, guide: bool | None = None,
                  protocol: str | None = None) -> Iterator[tuple]:
        """chat() on what submit() handed over, plus the timing view, which arrives with the turn's final
        status (done / error) and its completion marker."""
        submitted = submitted or {}
        if "refused" in submitted:  # (kept in the box by submit; no place taken, no wait for the running turn)
            gr.Warning(f"not sent: {submitted['refused']} messages are waiting for their answers; send this one "
                       "when one is answered")
            yield (gr.skip(),) * 9
            return
        page = PageSettings(use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt, seed, guide,
                            protocol)
        for output in self._turn(submitted.get("message", ""), page, request, submitted.get("ticket"),
                                 submitted.get("sent")):
            if output[2] == "running":
                yield (*output, gr.skip(), gr.skip(), gr.skip())
            else:
                yield (*output, *self.timing(request))

    def compare(self, message: str, use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt,
                request: gr.Request, seed=0, guide: bool | None = None, protocol: str | None = None,
                ticket: int | None = None) -> Iterator[tuple]:
        """The question with the cache on and off, on forks of the visitor's session (an empty box: the chat's last
        turn again, from where it was asked). Yields (result markdown, status, completion marker)."""
        page = PageSettings(use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt, seed, guide,
                            protocol)
        yield from self._compare("cache", message, page, request, ticket)

    def compare_guide(self, message: str, use_cache, max_length, max_new_tokens, max_turns, temperature, tools,
                      prompt, request: gr.Request, seed=0, guide: bool | None = None, protocol: str | None = None,
                      ticket: int | None = None) -> Iterator[tuple]:
        """compare() with the guide on and off instead (`guide`, the checkbox, is what the runs vary), the cache as
        set: what the guide chose, and what the model writes alone."""
        page = PageSettings(use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt, seed, guide,
                            protocol)
        yield from self._compare("guide", message, page, request, ticket)

    def _compare(self, what: str, message: str, page: PageSettings, request: gr.Request,
                 ticket: int | None) -> Iterator[tuple]:
        """compare() (`what` "cache") or compare_guide() ("guide") on the page's settings."""
        entry = self.store.get(request.session_hash)
        state = self.page_of(entry)
        cancel, mine = entry.chat_stop.begin(ticket), state.compare_started()
        try:
            yield gr.skip(), f"running: compare ({what} on, then off)", gr.skip()
            question = (message or "").strip()
            rerun = not question  # the chat's last turn again
            if rerun:
                last = entry.session.episodes[-1].question if entry.session and entry.session.episodes else ""
                if not last:
                    raise InputError("nothing to compare: type a question (or ask one in the chat first)")
                question = last
            engine, settings = self.page_settings(page)
            prompt = self._page_prompt(engine, page)
            session, turns = self.matching_session(entry, engine, prompt), None
            if session is None:  # no chat yet (or it used other tools or another prompt): a fresh session
                session = engine.new_session(prompt=prompt, use_cache=True, seed=settings.seed)
            elif rerun:
                turns = len(session.episodes) - 1  # from where the last turn was asked
            run, render = (compare, compare_markdown) if what == "cache" else (compare_guide, guide_markdown)
            # (room for a run that holds the whole session in a cache of its own: the cache-off run needs more
            # than the cached one; the guide's runs copy the session's cache)
            with self.job_slot(session, cancel, use_cache=False):
                result = run(engine, session, question, settings, cancel=cancel, turns=turns)
            state.compare_ended(mine)
            shown, status = render(result), done_status(state.unanswered_besides(), len(state.comparing),
                                                        result.stopped, protocol=engine.protocol.name)
            yield shown, status, finished_marker(state.chat_finished.bump())
        except Exception as error:  # handler boundary
            status = failure_status(error, "compare", request.session_hash)
            yield gr.skip(), status, finished_marker(state.chat_finished.bump())
        finally:
            state.compare_ended(mine)

    def stop(self, request: gr.Request) -> None:
        """The Chat tab's Stop: the running turn or Compare, and every one submitted before it."""
        self.store.cancel(request.session_hash)

    def new_chat(self, request: gr.Request) -> tuple:
        """An empty chat, but for messages already sent and waiting (they are answered in the new chat, so they
        show there at once); the box keeps what is typed."""
        entry = self.store.reset(request.session_hash)
        state = self.page_of(entry)
        state.new_chat()
        return (chat_messages([], waiting=state.waiting_messages()), gr.skip(), "new chat", [],
                self.stats(entry.session))

    def refresh(self, request: gr.Request) -> tuple:
        """Page load: a new page (a reload too) is a new Gradio session, so this shows an empty chat, the
        server's stats, the max_length field fitted to the backend, the default protocol's prompt, and registers
        the visitor; closing the page frees the session."""
        entry = self.store.get(request.session_hash)
        session = entry.session
        chat = chat_messages(session.episodes if session else [], self.page_of(entry).notes)
        return chat, self.token_view(session), self.stats(session), self.max_length_field(), self.prompt_field()

    def prompt_field(self) -> str:
        """The prompt box's value on page load: the default template of the protocol the selector starts on (what
        `auto` resolves to for this model, e.g. chat for a model whose template lists tools). Before the backend
        has loaded (never loaded here), or where that protocol cannot run on it, the box as built (textenv's)."""
        if self.loaded_backend() is None:
            return gr.skip()
        try:
            return self.engine_for(None, page_protocol()).protocol.default_template()
        except InputError:  # (the turn says why)
            return gr.skip()

    def max_length_field(self):
        """The max_length field for a backend whose context is shorter than the page's default: that context, and
        why. Else, or before the backend has loaded (never loaded here), the field as built: a turn sent with the
        page's default gets the backend's (make_settings)."""
        backend = self.loaded_backend()
        if backend is None or max_length_for(backend.context_limit) == DEFAULTS.max_length:
            return gr.skip()
        return gr.Number(value=max_length_for(backend.context_limit),
                         info=f"at most {backend.context_limit:,} tokens here (the model's context)")

    def unload(self, request: gr.Request) -> None:
        self.store.remove(request.session_hash)
