"""Protocols between model and tools, behind one interface (app.protocols.base.Protocol): `textenv` (TRL's
TextEnvironment markers, a few-shot prompt) and `chat` (the model's chat template with `tools=`, `<tool_call>` JSON).
`auto` picks the protocol the weights were tuned for (a LoRA adapter's), else `chat` where the tokenizer's own chat
template renders tools, else `textenv`."""

from __future__ import annotations

from app.protocols.base import Protocol, ToolCall, ToolCallError
from app.protocols.chat import ChatProtocol, chat_template_for
from app.protocols.chat_template import TemplateError, renders_tools
from app.protocols.naming import PromptError
from app.protocols.textenv import TextEnvProtocol

from app.settings import PROTOCOLS  # noqa: E402  (auto, textenv, chat)


def resolve(name: str, tokenizer, tuned_for: str | None = None) -> str:
    """The protocol `name` means for this tokenizer and weights: `auto` is the one the weights were tuned for
    (`tuned_for`), else `chat` where the tokenizer's own template renders tools, else `textenv`."""
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r} (choose one of {', '.join(PROTOCOLS)})")
    if name != "auto":
        return name
    if tuned_for in PROTOCOLS and tuned_for != "auto":
        return tuned_for
    return "chat" if renders_tools(tokenizer) else "textenv"


def make_protocol(name: str, tokenizer, special_token_texts: list[str] | tuple[str, ...] = (),
                  tuned_for: str | None = None) -> Protocol:
    """The protocol `name` (or `auto`'s choice) for a backend's tokenizer; `chat` uses the tokenizer's template where it
    renders tools, else the project's. ValueError where that template cannot follow a tool conversation."""
    chosen = resolve(name, tokenizer, tuned_for)
    if chosen == "textenv":
        return TextEnvProtocol(tokenizer, special_token_texts)
    try:
        return ChatProtocol(tokenizer, special_token_texts, chat_template_for(tokenizer))
    except TemplateError as error:
        raise ValueError(f"protocol chat: {error}") from None


__all__ = ["Protocol", "ToolCall", "ToolCallError", "ChatProtocol", "TextEnvProtocol", "PROTOCOLS", "PromptError",
           "make_protocol", "resolve"]
