"""What a tool is, what it returns and how it rejects a query: the types every tool imports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class ToolError(Exception):
    """A rejection with a short, user-facing message (shown to the model as `error: <message>`). `hint`: (another tool's
    name, advice naming it), added only where that tool is in the session's tool set."""

    def __init__(self, message: str, hint: tuple[str, str] | None = None):
        super().__init__(message)
        self.hint = hint


def _as_is(output: str) -> str:
    return output


@dataclass(frozen=True)
class Tool:
    name: str
    description: str  # one line, goes into the system prompt
    function: Callable[[str], str]
    answer: Callable[[str], str] = _as_is  # the answer a few-shot example gives from this tool's output
    ability: str = ""  # what the assistant has, in a greeting's words ("a calculator"): a prompt's {abilities}
    action: str = ""  # what a visitor may ask of it ("calculate"): a prompt's {actions} (none: "use <name>")
    # the query this tool takes from a question it claims, whatever the model writes; None: the model decides
    claims: Callable[[str], str | None] | None = None
    max_query: int = 200  # the longest input a guided call writes (app.decoding.guide): where it is reached, the call ends
    # the tool as a typed, documented function (app.tools.functions) for its JSON schema; None: no chat form
    typed: Callable[..., str] | None = None


@dataclass(frozen=True)
class ToolResult:
    text: str
    ok: bool
