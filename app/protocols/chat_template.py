"""What a chat template writes around a turn, a call and a tool result, read once by rendering the template with
placeholders. Appending these pieces keeps every earlier token as it is, so the KV cache resumes exactly after them; a
template that would render past turns differently is still followed by appending, never re-rendered."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from app.paths import ASSETS

_P = "\u2063P{}\u2063"  # placeholders: text no template writes (INVISIBLE SEPARATOR around a number)
_ANSWER, _QUESTION, _SYSTEM = "\u2063answer\u2063", "\u2063question\u2063", "\u2063system\u2063"
_PROBE = {"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"arg": {"type": "string", "description": "An argument."}}, "required": ["arg"]}}}


class TemplateError(ValueError):
    """The chat template renders no tools, or not in a way this protocol can follow."""


def own_template() -> str:
    """The project's tool-aware template for models whose own renders no tools (SmolLM2: assets/)."""
    return (ASSETS / "chat_template.jinja").read_text(encoding="utf-8")


def renders_tools(tokenizer, template: str | None = None) -> bool:
    """Whether a template (the tokenizer's own where None) lists the tools it is given."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "x"}]
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=[_PROBE], chat_template=template, tokenize=False)
        without = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception:  # (jinja raises its own errors for templates that do not know `tools`)
        return False
    return '"probe"' in with_tools and with_tools != without


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class CallSyntax:
    """How the template writes calls: `opening` + the call's JSON (a list where `listed`) + `between` + `tag`, e.g.
    `<tool_call>[` {...} `]` `</tool_call>` (SmolLM2's, assets/), `<tool_call>\n` {...} `\n` `</tool_call>` (Qwen's)."""

    opening: str
    between: str
    tag: str
    listed: bool


@dataclass(frozen=True)
class TemplatePieces:
    """A template's text around the conversation's parts, for one tokenizer."""

    tokenizer: object
    template: str | None  # None: the tokenizer's own

    def render(self, messages: list[dict], generation: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=[_PROBE], chat_template=self.template,
                                                      tokenize=False, add_generation_prompt=generation)
        except Exception as error:  # (jinja's and the template's own errors: raise_exception, undefined values)
            raise TemplateError(f"the chat template cannot render a tool conversation: {error}") from None

    @cached_property
    def _base(self) -> list[dict]:
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _QUESTION}]

    @cached_property
    def question(self) -> tuple[str, str]:
        """(the text from an answer's end to a question, from the question to the answer's start)."""
        # only the text after the answer is read, even where a template renders the answer differently later
        after = self.render(self._base + [{"role": "assistant", "content": _ANSWER},
                                          {"role": "user", "content": _P.format(0)}], True)
        tail = after[after.index(_ANSWER) + len(_ANSWER):]
        opening, _, closing = tail.partition(_P.format(0))
        return opening, closing

    @cached_property
    def call(self) -> CallSyntax:
        """How the template writes a call (TemplateError where it has no tags around a JSON object)."""
        prefix = self.render(self._base, True)
        text = self.render(self._base + [{"role": "assistant", "tool_calls": [_call("probe", {"arg": "v"})]}])
        if not text.startswith(prefix):
            raise TemplateError("the template renders a call's turn differently from its opening")
        text = text[len(prefix):]
        start = text.find('{"name"')
        if start < 0:
            raise TemplateError("the template writes calls in a format other than {\"name\": ..., \"arguments\": ...}")
        _, end = json.JSONDecoder().raw_decode(text, start)
        opening = text[:start]
        opening = opening[opening.rfind("<"):] if "<" in opening else opening  # (the tag: not a reasoning block before it)
        listed = opening.rstrip().endswith("[")
        close = text.find("</", end)
        tag = text[close: text.find(">", close) + 1] if close >= 0 else ""
        if not opening.strip() or not tag.endswith(">"):
            raise TemplateError("the template writes calls without an opening and a closing tag")
        return CallSyntax(opening, text[end:close], tag, listed)

    def results(self, count: int) -> list[str]:
        """The texts around `count` results after a call's closing tag: count + 1 pieces, the last one ending where
        the next answer starts."""
        calls = [_call("probe", {"arg": f"v{i}"}) for i in range(count)]
        messages = self._base + [{"role": "assistant", "tool_calls": calls}]
        messages += [{"role": "tool", "name": "probe", "content": _P.format(i)} for i in range(count)]
        text = self.render(messages, True)
        tag = self.call.tag
        start = text.rindex(tag, 0, text.index(_P.format(0))) + len(tag)  # (after the last call's closing tag)
        pieces, rest = [], text[start:]
        for i in range(count):
            piece, found, rest = rest.partition(_P.format(i))
            if not found:
                raise TemplateError("the template does not render a tool's result")
            pieces.append(piece)
        return pieces + [rest]
