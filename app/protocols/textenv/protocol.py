"""TRL's TextEnvironment protocol behind the Protocol interface: `<request><Tool>query<call>`, the tool's output plus
`<response>`, the answer `Result = ...<submit>`, taught by the few-shot prompt (assets/system_prompt.txt)."""

from __future__ import annotations

from collections.abc import Mapping

from app.decoding.guide import Guide, claimed_guide
from app.episode import Segment
from app.protocols.base import Protocol, ToolCall, ToolCallError, encode, special_marker_ids
from app.protocols.textenv.grammar import segment_guide
from app.protocols.textenv.markers import (CALL, CUT_STOPS, QUESTION_PREFIX, REQUEST, RESPONSE, STOP_STRINGS, SUBMIT,
                                           calls_tool, neutralize, parse_tool_call)
from app.protocols.textenv.prompt import default_prompt_template, render_prompt
from app.tools.base import Tool


class TextEnvProtocol(Protocol):
    """Every piece is plain text, tokenized with special-token texts kept as text (app.protocols.base.encode)."""

    name = "textenv"
    stop_strings = STOP_STRINGS
    cut_stops = CUT_STOPS
    answer_ends_at_eos = False  # (an answer ends at `<submit>`)
    answer_stops = (SUBMIT,)

    def __init__(self, tokenizer, special_token_texts: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.specials = tuple(special_token_texts)
        self.marker_ids = special_marker_ids(tokenizer, (REQUEST, CALL, RESPONSE, SUBMIT))

    def default_template(self) -> str:
        return default_prompt_template()

    def render_prompt(self, template: str, tools: Mapping[str, Tool]) -> str:
        return render_prompt(template, tools)

    def prompt_ids(self, prompt: str) -> list[int]:
        return encode(self.tokenizer, prompt)

    def query_ids(self, question: str, ids: list[int], first: bool) -> list[int]:
        separator = "" if first else "\n\n"
        return encode(self.tokenizer, f"{separator}{QUESTION_PREFIX}{self.neutralize(question)}\n")

    def calls(self, segment: Segment, ids: list[int], tools: Mapping[str, Tool]) -> list[ToolCall | ToolCallError]:
        if segment.stop is None or not calls_tool(segment.stop.string, segment.text):
            return []
        try:
            call = parse_tool_call(segment.text)
        except ToolCallError as error:  # (its message names the markers in look-alikes, as the model has always read)
            return [ToolCallError(self.neutralize(str(error)))]
        return [ToolCall(call.name, call.query)]

    def result_ids(self, segment: Segment, ids: list[int], text: str, index: int, count: int) -> list[int]:
        if segment.stop is not None and segment.stop.string == RESPONSE:  # `<response>` where `<call>` belongs (cut):
            text = CALL + text  # the engine closes the request, in this inserted (not generated) text
        return encode(self.tokenizer, text + RESPONSE)

    def neutralize(self, text: str) -> str:
        return neutralize(text, self.specials)

    def guide(self, tools: Mapping[str, Tool], claimed: ToolCall | None, after: Segment | None,
              calls: bool) -> Guide:
        if claimed is not None:
            return claimed_guide(self.call_text(claimed, tools))
        return segment_guide(tools, None, after, calls)

    def call_text(self, call: ToolCall, tools: Mapping[str, Tool]) -> str:
        return f"{REQUEST}<{call.name}>{call.query}{CALL}"
