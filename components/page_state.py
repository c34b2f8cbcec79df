"""One visitor's page beside their serving entry: the messages sent and not yet answered, those a Stop put back in
the box, the Compares running, the count of finished work per lane (the completion markers), the order of their
turn handlers and the notes above the chat. The page alone changes it, through PageState's methods; serving keeps
the chat itself (app/serving/sessions.py Entry). PageStates holds one per Entry, weakly: when the store lets an
entry go (the page closed, an idle sweep) and no handler still runs for it, its record goes with it."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from app.serving import ChatChange, Entry


def new_chat_notes(change: ChatChange, tools: Sequence[str]) -> list[str] | None:
    """The notes above the chat after Service.prepare did `change` (the engine's `tools`); None: keep them."""
    if change is ChatChange.KEPT:
        return None
    if change is ChatChange.TOOLS_CHANGED:
        listed = ", ".join(tools) or "none"
        return [f"Tools changed (now: {listed}), so the system prompt changed: started a new chat."]
    if change is ChatChange.PROTOCOL_CHANGED:
        return ["Protocol changed, so the system prompt changed: started a new chat."]
    if change is ChatChange.PROMPT_CHANGED:
        return ["System prompt changed: started a new chat."]
    return []  # (a note about a chat that has since been replaced unanswered is not this one's)


@dataclass
class Finished:
    """How many pieces of work of one lane (the Chat tab's turns and Compares, or the Batch tab's runs) a visitor has
    finished, for the page's completion marker: each bumps it once, with its final status."""

    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self) -> int:
        """Count one more finished piece of work; the new count."""
        with self._lock:  # (a turn and a Compare of the same visitor may end at once)
            self.count += 1
            return self.count


@dataclass(eq=False)
class PageState:
    """One visitor's page. Sent messages are numbered (send); each is unanswered until its turn ends (answered,
    not_sent) and waiting until its turn starts (started), so every waiting message is unanswered, and a number is
    never handed out twice. Read the fields; change them through the methods, which check that."""

    notes: list[str] = field(default_factory=list)  # shown above the chat (e.g. "tools changed: new chat")
    waiting: dict[int, str] = field(default_factory=dict)  # sent messages whose turn has not started, by number
    unanswered: set[int] = field(default_factory=set)  # sent messages whose turn has not ended (waiting or running)
    unsent: list[str] = field(default_factory=list)  # waiting messages a Stop put back in the box, since the last send
    comparing: set[object] = field(default_factory=set)  # Compare runs under way (they share the turns' status line)
    chat_finished: Finished = field(default_factory=Finished)  # chat turns and Compares that have ended
    batch_finished: Finished = field(default_factory=Finished)  # Batch runs that have ended
    # one chat turn's handler at a time, start to last update: each turn's final status ("done · 1 more message
    # to answer") reaches the page before the next turn's updates, never after them
    turn_order: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _numbers: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # (submit runs beside the turns)

    # ---- messages -------------------------------------------------------------------------------------------
    def send(self, message: str) -> int:
        """A message leaves the box: its number; it waits (and is unanswered) unless it is blank. The messages a
        Stop put back in the box are the visitor's again."""
        with self._lock:
            self.unsent.clear()
            number = next(self._numbers)
            if message.strip():
                self.waiting[number] = message
                self.unanswered.add(number)
            self._check()
            return number

    def started(self, number: int | None) -> None:
        """Its turn has started: the episode shows the message from now on."""
        with self._lock:
            self.waiting.pop(number, None)

    def answered(self, number: int | None) -> None:
        """Its turn has ended, whatever ended it."""
        with self._lock:
            self.waiting.pop(number, None)
            self.unanswered.discard(number)

    def not_sent(self, number: int | None, message: str) -> list[str]:
        """A Stop kept it from the model: it goes back to the box, with every other message the same Stop kept;
        those messages, in the order they were sent."""
        with self._lock:
            self.waiting.pop(number, None)
            self.unanswered.discard(number)
            self.unsent.append(message)
            return list(self.unsent)

    def waiting_messages(self) -> list[str]:
        """The messages waiting for their turn, in the order they were sent."""
        with self._lock:
            return list(self.waiting.values())  # (numbered, hence added, in that order)

    def unanswered_besides(self, number: int | None = None) -> int:
        """How many sent messages are unanswered, `number` aside."""
        with self._lock:
            return len(self.unanswered - {number})

    # ---- Compare runs and notes -----------------------------------------------------------------------------
    def compare_started(self) -> object:
        """A Compare run begins: its token, for compare_ended."""
        token = object()
        with self._lock:
            self.comparing.add(token)
        return token

    def compare_ended(self, token: object) -> None:
        with self._lock:
            self.comparing.discard(token)

    def chat_changed(self, change: ChatChange, tools: Sequence[str]) -> None:
        """Service.prepare did `change` to the chat (the engine's `tools`): the notes say so."""
        notes = new_chat_notes(change, tools)
        if notes is not None:
            self.notes = notes

    def new_chat(self) -> None:
        """New chat: no note of the chat before it stays."""
        self.notes = []

    def _check(self) -> None:
        stray = sorted(self.waiting.keys() - self.unanswered)
        if stray:
            raise RuntimeError(f"page state: messages {stray} wait for a turn but are not unanswered")


class PageStates:
    """Every visitor's PageState, keyed by their serving Entry and held weakly by it: it lives while the store holds
    the entry (or a handler still runs with it) and goes with it, freed by the same unload or idle sweep."""

    def __init__(self) -> None:
        self._records: weakref.WeakKeyDictionary[Entry, PageState] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def of(self, entry: Entry) -> PageState:
        """The entry's page state, created when missing."""
        with self._lock:
            record = self._records.get(entry)
            if record is None:
                record = self._records[entry] = PageState()
            return record

    def peek(self, entry: Entry | None) -> PageState | None:
        """The entry's page state if it has one, without creating it."""
        if entry is None:
            return None
        with self._lock:
            return self._records.get(entry)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
