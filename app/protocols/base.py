"""What a protocol is: how a session's text becomes token ids, where a model segment stops, how a tool call is read and
its result goes back, what untrusted text may not forge, and the guide's grammar. The engine knows only this interface;
app.protocols.textenv and app.protocols.chat implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from app.decoding.guide import Guide
from app.episode import Segment, Stop, StopReason
from app.tools.base import Tool


@dataclass(frozen=True)
class ToolCall:
    """A call the model asked for: the tool's name and its one argument."""

    name: str
    query: str


class ToolCallError(ValueError):
    """A call the model wrote but that cannot run (no well-formed request, bad JSON, an unknown tool or argument):
    the model reads this message."""


def encode(tokenizer, text: str) -> list[int]:
    """Untrusted text's ids, as every protocol tokenizes it: no BOS, special-token texts kept as text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


class Protocol(ABC):
    """One way for model and tools to talk. Built per backend and tool set (it reads the tokenizer); immutable."""

    name: str
    stop_strings: tuple[str, ...]  # where a model segment stops (with EOS and the length limits)
    cut_stops: frozenset[str] = frozenset()  # stop strings dropped from the segment's tokens (not part of it)
    answer_ends_at_eos: bool = True  # a finished answer's last token is EOS (textenv's is its `<submit>` marker)
    answer_stops: tuple[str, ...] = ()  # stop strings that end an answer, as EOS does (textenv's `<submit>`)
    # the protocol's markers the tokenizer has as special tokens (Qwen's `<tool_call>`): a segment's text shows them
    marker_ids: frozenset[int] = frozenset()

    @abstractmethod
    def default_template(self) -> str:
        """The prompt template a session starts from (a file in assets/), editable on the page."""

    @abstractmethod
    def render_prompt(self, template: str, tools: Mapping[str, Tool]) -> str:
        """The system prompt the model reads, examples filled in by the tools; raises
        app.protocols.naming.PromptError where an example's tool rejects it."""

    @abstractmethod
    def prompt_ids(self, prompt: str) -> list[int]:
        """A rendered prompt's token ids."""

    @abstractmethod
    def query_ids(self, question: str, ids: list[int], first: bool) -> list[int]:
        """The ids a turn adds for its (clean, untrusted) question after the session's `ids`; `first`: no turn
        before it."""

    @abstractmethod
    def calls(self, segment: Segment, ids: list[int], tools: Mapping[str, Tool]) -> list[ToolCall | ToolCallError]:
        """The tool calls a finished model segment asks for, in order (empty: it answered); a malformed call is a
        ToolCallError in its place. `ids`: the segment's token ids."""

    @abstractmethod
    def result_ids(self, segment: Segment, ids: list[int], text: str, index: int, count: int) -> list[int]:
        """The ids of call `index` of `count`'s (neutralized) result `text`, appended after the calling segment
        (`segment`, its `ids`) or the previous result: the next model segment resumes right after the last."""

    @abstractmethod
    def neutralize(self, text: str) -> str:
        """Untrusted text (a question, a tool's output) made unable to forge a marker or a special token."""

    @abstractmethod
    def guide(self, tools: Mapping[str, Tool], claimed: ToolCall | None, after: Segment | None,
              calls: bool) -> Guide:
        """A model segment's guide: the claimed call (forced), else what the model may write after
        the question or after `after`, a tool segment; `calls`: whether another call may run (max_turns)."""

    def ends_answer(self, stop: Stop | None) -> bool:
        """Whether the model ended its answer itself (EOS, or one of `answer_stops`), not a limit or Stop."""
        return stop is not None and (stop.reason is StopReason.EOS or stop.string in self.answer_stops)

    @abstractmethod
    def call_text(self, call: ToolCall, tools: Mapping[str, Tool]) -> str:
        """The text of `call` as the model writes it, ending with the stop string that ends a call."""


def special_marker_ids(tokenizer, markers: tuple[str, ...]) -> frozenset[int]:
    """The ids of those `markers` that the tokenizer has as special tokens, one id each."""
    specials = set(tokenizer.all_special_tokens)
    return frozenset(tokenizer.convert_tokens_to_ids(m) for m in markers if m in specials)
