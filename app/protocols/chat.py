"""Tool calls in the model's own chat format: the chat template renders the tools, the conversation and each tool
result, and the model writes `<tool_call>` JSON.

The prompt is rendered once; every later piece is the template's own text around it (app.protocols.chat_template),
appended as ids, so the session's ids never change and the KV cache resumes after them. A segment ends at
`</tool_call>`, EOS or a length limit; its calls are validated against the tools' JSON schemas and run in order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from app.decoding.guide import Guide, claimed_guide
from app.episode import Segment, StopReason
from app.protocols.base import Protocol, ToolCall, ToolCallError, encode, special_marker_ids
from app.protocols.chat_guide import chat_guide
from app.protocols.chat_prompt import default_chat_template, render_chat_prompt, tool_schema
from app.protocols.chat_template import TemplatePieces, own_template, renders_tools
from app.tools.base import Tool


def chat_template_for(tokenizer) -> str | None:
    """The template the chat protocol renders with: the tokenizer's own where it renders tools (None), else the
    project's own (assets/chat_template.jinja, ChatML, written for SmolLM2)."""
    if renders_tools(tokenizer):
        return None
    return own_template()


class ChatProtocol(Protocol):
    """The chat template's protocol for one tokenizer; TemplateError where the template cannot be followed."""

    name = "chat"

    def __init__(self, tokenizer, special_token_texts: list[str] | tuple[str, ...] = (), template: str | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.specials = tuple(special_token_texts)
        self.pieces = TemplatePieces(tokenizer, template)
        self.syntax = self.pieces.call
        self.opening, self.closing, self.listed = self.syntax.opening, self.syntax.tag, self.syntax.listed
        self.stop_strings = (self.closing,)
        self.open_tag = self.opening.strip().rstrip("[").strip()
        names = sorted({self.open_tag.strip("</>"), self.closing.strip("</>"), "tool_response", "tools"})
        self._markers = re.compile(r"<\s*/?\s*(" + "|".join(map(re.escape, names)) + r")\s*>", re.IGNORECASE)
        self.marker_ids = special_marker_ids(tokenizer, (self.open_tag, self.closing))

    # ---- text <-> ids -----------------------------------------------------------------------------------------
    def _template_ids(self, text: str) -> list[int]:
        """The template's own text: its special-token texts are the special tokens."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _text_ids(self, text: str) -> list[int]:
        """Untrusted text: special-token texts stay text (and neutralize has made them look-alikes)."""
        return encode(self.tokenizer, text)

    def _after(self, ids: list[int], text: str) -> str:
        """`text` without the special token it starts with where the session's last id is that token (the EOS
        the model wrote where the template closes its message)."""
        last = self.tokenizer.decode(ids[-1:]) if ids else ""
        return text[len(last):] if last in self.specials and text.startswith(last) else text

    # ---- the interface ----------------------------------------------------------------------------------------
    def default_template(self) -> str:
        return default_chat_template()

    def render_prompt(self, template: str, tools: Mapping[str, Tool]) -> str:
        return render_chat_prompt(self.tokenizer, self.template, template, tools, self.neutralize)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._template_ids(prompt)

    def query_ids(self, question: str, ids: list[int], first: bool) -> list[int]:
        opening, closing = self.pieces.question
        # after the prompt or an answer the text ends with the part of `opening` that closes an answer, or none of it
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False)
        cut = next((n for n in range(len(opening), 0, -1) if tail.endswith(opening[:n])), 0)
        return (self._template_ids(opening[cut:]) + self._text_ids(self.neutralize(question))
                + self._template_ids(closing))

    def calls(self, segment: Segment, ids: list[int], tools: Mapping[str, Tool]) -> list[ToolCall | ToolCallError]:
        stop = segment.stop
        text = segment.text
        if stop is not None and stop.string == self.closing:
            start = text.rfind(self.open_tag)
            if start < 0:
                return [ToolCallError(f"{self.closing} without {self.open_tag} before it; write "
                                      f"{self.example(tools)}")]
            return self.parse(text[start + len(self.open_tag): text.rfind(self.closing)], tools)
        if stop is not None and stop.reason is StopReason.EOS and _looks_like_call(text):
            return [ToolCallError(f"a tool call goes between {self.open_tag} and {self.closing}: write "
                                  f"{self.example(tools)}")]
        return []

    def parse(self, body: str, tools: Mapping[str, Tool]) -> list[ToolCall | ToolCallError]:
        """The calls in the JSON between a call's tags: one object, or a list of them."""
        try:
            data = json.loads(body)
        except json.JSONDecodeError as error:
            return [ToolCallError(f"the call is not valid JSON ({error.msg} at character {error.pos}); write "
                                  f"{self.example(tools)}")]
        items = data if isinstance(data, list) else [data]
        if not items:
            return [ToolCallError("the call's list is empty")]
        return [self.validate(item, tools) for item in items]

    def validate(self, item: object, tools: Mapping[str, Tool]) -> ToolCall | ToolCallError:
        """One call checked against the tools' schemas: a known tool, its one argument, of its type."""
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return ToolCallError('a call is {"name": "tool name", "arguments": {...}}')
        schemas = {tool_schema(tool)["name"]: (tool, tool_schema(tool)) for tool in tools.values() if tool.typed}
        if item["name"] not in schemas:
            known = ", ".join(schemas) or "none"
            return ToolCallError(f"unknown tool {item['name']!r} (the tools: {known})")
        tool, schema = schemas[item["name"]]
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):  # (some models write the arguments as a JSON string)
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ToolCallError(f"{item['name']}'s arguments are not a JSON object")
        params = schema["parameters"]
        if not isinstance(arguments, dict):
            return ToolCallError(f"{item['name']}'s arguments are not a JSON object")
        missing = [p for p in params.get("required", []) if p not in arguments]
        extra = [a for a in arguments if a not in params["properties"]]
        if missing or extra:
            problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unknown {', '.join(map(str, extra))}"] if extra else [])
            return ToolCallError(f"{item['name']} takes {', '.join(params['properties'])}: {'; '.join(problems)}")
        (argument,) = params["properties"]  # (a tool takes one argument: its query)
        value = arguments[argument]
        if params["properties"][argument].get("type") == "string" and not isinstance(value, str):
            return ToolCallError(f"{item['name']}'s {argument} must be a string")
        return ToolCall(tool.name, str(value))

    def result_ids(self, segment: Segment, ids: list[int], text: str, index: int, count: int) -> list[int]:
        pieces = self.pieces.results(count)
        before = self._after(ids, pieces[index]) if index == 0 else pieces[index]
        out = self._template_ids(before) + self._text_ids(text)
        return out + self._template_ids(pieces[count]) if index == count - 1 else out

    def neutralize(self, text: str) -> str:
        text = self._markers.sub(lambda m: f"‹{m[0].strip('<>').strip()}›", text)
        for special in self.specials:
            if special in text:
                text = text.replace(special, special.replace("<", "‹").replace(">", "›"))
        return text

    def guide(self, tools: Mapping[str, Tool], claimed: ToolCall | None, after: Segment | None,
              calls: bool) -> Guide:
        if claimed is not None:
            return claimed_guide(self.call_text(claimed, tools))
        return chat_guide(tools, self.syntax, after, calls)

    def call_text(self, call: ToolCall, tools: Mapping[str, Tool]) -> str:
        schema = tool_schema(tools[call.name])
        body = {"name": schema["name"], "arguments": {next(iter(schema["parameters"]["properties"])): call.query}}
        return self.opening + json.dumps(body, ensure_ascii=False) + self.syntax.between + \
            self.closing

    def example(self, tools: Mapping[str, Tool]) -> str:
        """A well-formed call of the session's first tool, for error messages."""
        tool = next((t for t in tools.values() if t.typed), None)
        if tool is None:
            return f'{self.open_tag}{{"name": ..., "arguments": {{...}}}}{self.closing}'
        schema = tool_schema(tool)
        argument = next(iter(schema["parameters"]["properties"]))
        body = {"name": schema["name"], "arguments": {argument: "..."}}
        return self.open_tag + json.dumps([body] if self.listed else body) + self.closing


def _looks_like_call(text: str) -> bool:
    """A reply that is a call's JSON without its tags: `{"name": ...}` or a list of such objects."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return False
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError:
        return '"name"' in stripped and '"arguments"' in stripped
    items = data if isinstance(data, list) else [data]
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)
