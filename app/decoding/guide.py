"""Guided answers: one declared grammar (GBNF) per model segment, plus the text it opens with (forced), and the pieces
every protocol's grammar shares. The protocols build each guide from their markers, the session's tools and the last
tool output (docs/guided-answers.md); every token the guide decides is recorded as such."""

from __future__ import annotations

import re
from dataclasses import dataclass

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")  # the Calculator's output (app.tools.numbers.format_number)
ANSWER_PREFIX = "Result ="  # opens the answer line, in both protocols' examples and guides
# Free text on a line: no newline and no tag (a `<` only before a space, a digit or `=`), as a named rule of
# character classes, which grammar engines compile into fast lexemes.
TEXT_RULE = 'text ::= ([^\\n<] | "<" [ 0-9=])*'


@dataclass(frozen=True)
class Guide:
    """One segment's guide: `opening`, text the segment starts with, every token forced (a claimed call: a whole reply
    that ends with a stop string, so the model does not run), and `grammar` (GBNF) of what the model may write after
    it (None: nothing to constrain)."""

    grammar: str | None
    opening: str = ""


def literal(text: str) -> str:
    """`text` as a GBNF string literal: quotes, backslashes and control characters escaped, everything else as it is."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def claimed_guide(call: str) -> Guide:
    """The guide of a reply whose call a tool claims: the whole call is forced."""
    return Guide(None, call)


def owed_text(output: str, ok: bool, answer) -> str | None:
    """What the answer line begins with after a tool's `output`: the tool's `answer` of a result, an error's first
    line; None where there is nothing to copy."""
    line = (answer(output) if ok else output).split("\n", 1)[0].strip()
    return line or None
