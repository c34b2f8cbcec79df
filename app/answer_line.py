"""The answer is one line ended by `<submit>`: once the model has begun its `Result = ...` line, it cannot start a
new line, and a `<` it writes there followed by letters can only spell `<submit>`.

The prompt's format writes every answer as one line ended by `<submit>`. A small model often ends a short answer
("Result = Goodbye!") with a newline instead, then writes the next few-shot example ("\\nQ: ..."), or closes it
with the tools' marker (`Result = Good morning!<response>`); the stops catch both, but the answer then ends
without `<submit>`. Masking the tokens that would do either while the model is on its answer line leaves it the
choices the format allows: go on, `<submit>`, or EOS. A `<` not followed by a letter ("3 < 5") stays free.

This is a constraint on the next token, like a grammar in serving engines: deterministic, applied in the same
way with the cache on or off and to verified drafts, so greedy output stays a pure function of the token ids.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from app.protocol import ANSWER_PREFIX, SUBMIT

if TYPE_CHECKING:
    import torch

_TAG = re.compile(r"<([A-Za-z]*)")
_OPEN_TAG = re.compile(r"<([A-Za-z]*)$")
_END = SUBMIT[1:-1]  # "submit": the one tag the answer line may hold


def breaks_the_line(text: str) -> bool:
    """Whether text, on the answer line, holds a newline or a `<tag` that is not (the start of) `<submit>`."""
    if "\n" in text:
        return True
    for tag in _TAG.finditer(text):
        name, closed = tag[1], tag.end() < len(text)
        if name and (name != _END if closed else not _END.startswith(name)):
            return True
    return False


class AnswerLine:
    """One segment's view of the line the model is writing: whether it is the answer line, and the `<tag` its
    text ends with. Fed the segment's text as it grows; a segment starts on a new line (after the question's
    line or a tool's `<response>`)."""

    def __init__(self, prefix: str = ANSWER_PREFIX):
        self._prefix = prefix
        self._opening = ""  # the line's first characters: whether it is the answer line
        self._end = ""  # its last characters: an open `<tag`

    @property
    def on_answer(self) -> bool:
        """Whether the answer line's grammar applies now: the current line opens with the answer prefix."""
        return self._opening.lstrip().startswith(self._prefix)

    @property
    def open_tag(self) -> str | None:
        """The letters after a `<` the line ends with ("" right after the `<`), else None."""
        found = _OPEN_TAG.search(self._end)
        return None if found is None else found[1]

    def copy(self) -> "AnswerLine":
        other = AnswerLine(self._prefix)
        other._opening, other._end = self._opening, self._end
        return other

    def push(self, delta: str) -> None:
        if "\n" in delta:
            self._opening = self._end = ""
            delta = delta.rsplit("\n", 1)[-1]
        self._opening = (self._opening + delta)[: len(self._prefix) + 8]
        self._end = (self._end + delta)[-len(SUBMIT):]  # long enough for an open `<submit`


class AnswerGrammar:
    """The tokens banned on the answer line, for one tokenizer: each token's text is decoded once per model
    (~0.3 s), and the banned set for each open `<tag` state (a handful) is computed when first needed."""

    def __init__(self, tokenizer):
        self._texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        self._banned: dict[str | None, tuple[torch.Tensor, frozenset[int]]] = {}

    def text(self, token: int) -> str:
        """A token's text, as decoded once here (no tokenizer call, so no lock)."""
        return self._texts[token]

    def banned(self, line: AnswerLine) -> tuple[torch.Tensor, frozenset[int]] | None:
        """(ids as a tensor, the same as a set) of the tokens the line cannot take next; None off the answer line."""
        if not line.on_answer:
            return None
        state = line.open_tag
        if state not in self._banned:
            import torch

            head = "" if state is None else "<" + state
            ids = [i for i, text in enumerate(self._texts) if breaks_the_line(head + text)]
            self._banned[state] = (torch.tensor(ids, dtype=torch.long), frozenset(ids))
        return self._banned[state]

    def mask(self, logits: torch.Tensor, line: AnswerLine) -> torch.Tensor:
        """One position's logits with the tokens the line cannot take at -inf (the logits themselves when none)."""
        banned = self.banned(line)
        if banned is None:
            return logits
        out = logits.clone()
        out[banned[0]] = float("-inf")
        return out
