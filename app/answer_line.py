"""The answer is one line: once the model has begun its `Result = ...` line, it cannot start a new line.

The prompt's format writes every answer as one line ended by `<submit>`. A small model often ends a short answer
("Result = Goodbye!") with a newline instead, then writes the next few-shot example ("\\nQ: ..."); the `\\nQ:`
stop catches that, but the answer then ends without `<submit>`. Masking the tokens that hold a newline while the
model is on its answer line leaves it the choices the format allows: go on, `<submit>`, or EOS.

This is a constraint on the next token, like a grammar in serving engines: deterministic, applied in the same
way with the cache on or off and to verified drafts, so greedy output stays a pure function of the token ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.protocol import ANSWER_PREFIX

if TYPE_CHECKING:
    import torch


def newline_token_ids(tokenizer) -> list[int]:
    """Every token whose text holds a newline (129 of SmolLM2's 49,152; ~0.2 s, once per model)."""
    return [i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])]


class AnswerLine:
    """One segment's view of the line the model is writing: whether it is the answer line. Fed the segment's
    text as it grows; a segment starts on a new line (after the question's line or a tool's `<response>`)."""

    def __init__(self, prefix: str = ANSWER_PREFIX):
        self._prefix = prefix
        self._line = ""

    @property
    def on_answer(self) -> bool:
        """Whether a newline is masked now: the current line opens with the answer prefix."""
        return self._line.lstrip().startswith(self._prefix)

    def copy(self) -> "AnswerLine":
        other = AnswerLine(self._prefix)
        other._line = self._line
        return other

    def push(self, delta: str) -> None:
        self._line = (self._line + delta).rsplit("\n", 1)[-1][: len(self._prefix) + 8]  # only its opening matters


def mask(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """A copy of one position's logits with the banned tokens at -inf."""
    out = logits.clone()
    out[banned] = float("-inf")
    return out
