"""The tokens each answer-line state (app.answer_line.AnswerLine) allows, for one tokenizer.

This is a constraint on the next token, like a grammar in serving engines: deterministic, applied in the same
way with the cache on or off and to verified drafts, so greedy output stays a pure function of the token ids.
Each rule's token set is computed once per state and kept (a handful of states; more per tool result: a quoted
line one a token it spells, bounded by `_forget_tool_states`).
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import TYPE_CHECKING

from app.answer_line import (
    CALL_ENDS,
    AnswerLine,
    asks_next,
    breaks_the_line,
    number_allows,
    opens_well,
    owed_allows,
    spells_submit,
    writes_it_twice,
)
from app.protocol import CALL, QUESTION_PREFIX, REQUEST, RESPONSE, SUBMIT
from app.tools.search import NO_RESULTS, first_entry

if TYPE_CHECKING:
    import torch

# A call and its output, a number alone (the Calculator's: app.tools.numbers.format_number: 943, -24, 0.3, 1.5e20;
# also a sum Search passed on to it, see app.tools.registry.Misrouted), at the end of the ids
_CALCULATED = re.compile(re.escape(REQUEST) + r"<[A-Za-z]+>[^<]*" + re.escape(CALL) + r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"
                         + re.escape(RESPONSE) + r"\Z")
# A Search call (the Jargon File's tool, app.tools.registry) and its output (no tag; not an error, not "no
# results"), at the end of the ids
_LOOKED_UP = re.compile(re.escape(REQUEST) + r"<Search>[^<]*" + re.escape(CALL) + r"(?!error: |"
                        + re.escape(NO_RESULTS) + r")([^<]+)" + re.escape(RESPONSE) + r"\Z")
# Any tool's call and its error (app.tools.registry.run_tool: `error: ...`, one line), at the end of the ids
_FAILED = re.compile(re.escape(REQUEST) + r"<[A-Za-z]+>[^<]*" + re.escape(CALL) + r"(error: [^<\n]+)"
                     + re.escape(RESPONSE) + r"\Z")
_NUMBER_START = frozenset("0123456789-+.")
_SPLIT_CHAR = "\ufffd"  # a token's text where it holds a part of a character


def _writes_a_number(text: str) -> bool:
    return text.lstrip()[:1] in _NUMBER_START


class AnswerGrammar:
    """The tokens banned on the answer line, for one tokenizer: each token's text is decoded once per model
    (~0.3 s), and the banned set for each open `<tag` state (a handful) is computed when first needed."""

    def __init__(self, tokenizer):
        self._texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        self._newlines = [i for i, text in enumerate(self._texts) if "\n" in text and not text.strip()]
        self._lt = self._texts.index(SUBMIT[0])  # the `<` that opens `<submit>`
        self._close = self._texts.index(")")
        # for the Calculator's number (number_allows): the tokens that begin a number; all (text, id), sorted
        self._numeric = [i for i, text in enumerate(self._texts) if _writes_a_number(text)]
        self._sorted = sorted((text, i) for i, text in enumerate(self._texts))
        self._exact: dict[str, list[int]] = {}  # text -> the ids whose text it is
        for i, text in enumerate(self._texts):
            self._exact.setdefault(text, []).append(i)
        # (rule, its state) -> the ids it bans (or, for `allowed`, keeps), each computed once
        self._banned: dict[tuple, torch.Tensor | None] = {}

    def text(self, token: int) -> str:
        """A token's text, as decoded once here (no tokenizer call, so no lock)."""
        return self._texts[token]

    def calculated(self, ids: list[int]) -> str | None:
        """The Calculator's output when these ids end with its call and output (the number the answer writes)."""
        found = _CALCULATED.search("".join(self._texts[i] for i in ids[-64:]))
        return found[1] if found else None

    def quoted(self, ids: list[int]) -> str | None:
        """The line of a tool's output an answer opens with, when these ids end with a call and that output: a
        look-up's first entry (the best; app.tools.search.first_entry, which the prompt's examples copy), or a
        tool's error. None after "no results", a number (calculated), or an output not within the last 200 ids."""
        text = "".join(self._texts[i] for i in ids[-200:])
        if found := _LOOKED_UP.search(text):
            line = first_entry(found[1])
            line = line if ": " in line else None  # (entries are `term: definition` lines)
        else:
            line = found[1] if (found := _FAILED.search(text)) else None
        # a character split over tokens reads as U+FFFD in their texts, and as nothing until whole in the line's:
        # the quote stops before it (a review: "½", "™", soft hyphens held the answer at the same byte)
        return (line.split(_SPLIT_CHAR, 1)[0].rstrip() or None) if line else None

    def follows_a_question(self, ids: list[int]) -> bool:
        """Whether a segment that starts after these ids starts the reply to a question: they end with the
        question's line ("Q: ...\n", as app.engine writes it), whole within the last 1,200 ids (a longer line is
        not recognised, and has no such rule)."""
        text = "".join(self._texts[i] for i in ids[-1200:])
        line = text[:-1].rsplit("\n", 1)
        return text.endswith("\n") and len(line) == 2 and line[1].startswith(QUESTION_PREFIX)

    def follows_a_tool(self, ids: list[int]) -> bool:
        """Whether a segment that starts after these ids follows a tool's output: the texts of the last few ids end
        with the tools' `<response>` marker."""
        return "".join(self._texts[i] for i in ids[-len(RESPONSE):]).endswith(RESPONSE)

    def banned(self, line: AnswerLine) -> torch.Tensor | None:
        """The ids of the tokens the line cannot take next; None off the answer line (and not right after the
        question or a tool's output)."""
        if line.head is not None:
            head = line.head
            return self._ban(("after tool", head), lambda text: not opens_well(head + text))
        if line.start is not None:
            start = line.start
            return self._ban(("after question", start), lambda text: asks_next(start + text))
        if not line.on_answer:
            return None
        state = line.open_tag
        if state is not None and line.glued_tag:  # "Result = Toaster<": `submit>` only (not "Toaster<1><submit>")
            return self._ban(("glued", state), lambda text: not spells_submit("<" + state + text))
        tag = "" if state is None else "<" + state
        banned = self._ban(("answer", state), lambda text: breaks_the_line(tag + text))
        written, number = line.owed_due, line.owed
        if not line.numeric or written is None or not written.startswith(number) or state is not None:
            return banned  # (no number, or not yet whole: allowed(), not a ban)
        # right after the number ("64", "64."): those that go on with it. Which those are depends on what the line
        # wrote after the number only (number_allows is then "not _goes_on_a_number(tail + text)"), so one state
        # serves every number: keyed by the number too, each Calculator result scanned the ~3,000 number tokens
        # again (15 ms a result in the scheduler's thread, with every row waiting)
        key = ("number", written[len(number):])
        if key not in self._banned:
            import torch

            barred = [i for i in self._numeric if not number_allows(written, number, self._texts[i])]
            self._banned[key] = torch.cat([banned, torch.tensor(barred, dtype=torch.long)])  # (repeats do no harm)
        return self._banned[key]

    def allowed(self, line: AnswerLine) -> torch.Tensor | None:
        """Until the answer line has written the tool's output it owes (the Calculator's number, a look-up's entry,
        an error) whole, the only tokens it may take (those that go on with it, or end it): a few ids, so a row's
        mask keeps them rather than banning the whole vocabulary (which cost 20 chats at once ~1 s a turn). None
        where no token goes on with it: the model's choice then, not no token at all."""
        written, owed = line.owed_due, line.owed
        if written is None or written.startswith(owed) or line.open_tag is not None:
            return None
        key = ("allowed", owed, written)
        if key not in self._banned:
            import torch

            self._forget_tool_states()
            rest = owed[len(written):]
            # (the tokens that are a part of it exactly: looked up, not scanned; the first part is often " ", the
            # start of ~32,000 tokens' texts: 13 ms a new number, in the scheduler's thread)
            allowed = self._parts(rest, len(rest) - 1)
            allowed += [i for i in self._starting(rest) if owed_allows(written, owed, self._texts[i], line.numeric)]
            self._banned[key] = torch.tensor(sorted(allowed), dtype=torch.long) if allowed else None
        return self._banned[key]

    def _spelling(self, rest: str) -> torch.Tensor | None:
        """The tokens that spell the next part of `rest` (each token is a prefix of it; the model picks how it is
        cut); None where no token does (no constraint rather than no token at all)."""
        key = ("opening", rest)
        if key not in self._banned:
            import torch

            self._forget_tool_states()
            ids = sorted(self._parts(rest, len(rest)))
            self._banned[key] = torch.tensor(ids, dtype=torch.long) if ids else None
        return self._banned[key]

    def _parts(self, text: str, longest: int) -> list[int]:
        """The ids of the tokens whose text is `text`'s first 1 to `longest` characters: looked up, not scanned."""
        return [i for k in range(1, longest + 1) for i in self._exact.get(text[:k], ())]

    def _starting(self, prefix: str) -> list[int]:
        """The ids of the tokens whose text starts with `prefix` (from the sorted texts)."""
        first = bisect.bisect_left(self._sorted, (prefix, -1))
        return [i for _, i in itertools.takewhile(lambda item: item[0].startswith(prefix), self._sorted[first:])]

    def _forget_tool_states(self) -> None:
        """Bound the cache: each tool result adds a few states (a number a few, a quoted line one a token it spells)."""
        if len(self._banned) > 2048:
            for old in [k for k in self._banned if k[0] in ("number", "allowed", "opening")]:
                del self._banned[old]

    def _ban(self, key: tuple, bans) -> torch.Tensor:
        if key not in self._banned:
            import torch

            self._banned[key] = torch.tensor([i for i, text in enumerate(self._texts) if bans(text)], dtype=torch.long)
        return self._banned[key]

    def mask(self, logits: torch.Tensor, line: AnswerLine) -> torch.Tensor:
        """One position's logits with the tokens the line cannot take at -inf (the logits themselves when none).
        Where the answer line can end, the newlines' probability goes to the `<` of `<submit>`: a newline is how
        the model ends a line, and the format ends the answer's line with `<submit>`; while a bracket is open,
        that probability goes to `)` instead, and the `<` too."""
        if (rest := line.opening_due) is not None:  # a claimed call: its tokens only (no other rule applies)
            spelling = self._spelling(rest)
            return logits if spelling is None else _keep(logits, spelling)
        if line.call_input is not None:
            return self._in_call(logits, line)
        banned = self.banned(line)
        if banned is None:
            return logits
        allowed = self.allowed(line)
        out = logits.clone()
        if line.can_end:
            import torch

            ending = torch.logaddexp(out[self._lt], out[self._newlines].logsumexp(0))
            if line.owes_bracket:
                out[self._close], ending = torch.logaddexp(out[self._close], ending), float("-inf")
            out[self._lt] = ending
        out[banned] = float("-inf")
        return out if allowed is None else _keep(out, allowed)  # (after the bans: allowed and banned stays banned)


    def _in_call(self, logits: torch.Tensor, line: AnswerLine) -> torch.Tensor:
        """A call's input: one line, whose newline's probability goes to the `<` that ends it, and where a `<` can
        only begin a tag that ends it; once that tag is begun, or the input writes a span twice (writes_it_twice),
        the tokens that go on spelling it only (or that complete it and go on: a stop ends inside a token)."""
        closing = line.call_closing
        if closing is not None or writes_it_twice(line.call_input):
            key = ("call ends", closing or "")
            if key not in self._banned:
                import torch

                rests = [end[len(closing or ""):] for end in (CALL_ENDS if closing else (CALL,))
                         if end.startswith(closing or "")]
                ids = {i for rest in rests for i in self._parts(rest, len(rest)) + self._starting(rest)}
                self._banned[key] = torch.tensor(sorted(ids), dtype=torch.long) if ids else None
            allowed = self._banned[key]
            return logits if allowed is None else _keep(logits, allowed)
        import torch

        out = logits.clone()
        out[self._lt] = torch.logaddexp(out[self._lt], out[self._newlines].logsumexp(0))
        out[self._ban(("call",), _leaves_a_call)] = float("-inf")
        return out


def _leaves_a_call(text: str) -> bool:
    """Whether a token, in a call's input, breaks its line or opens a tag other than one that ends the call."""
    if "\n" in text:
        return True
    tag = text[text.index("<"):] if "<" in text else None
    return tag is not None and not any(end.startswith(tag) or tag.startswith(end) for end in CALL_ENDS)


def _keep(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `ids` alone, the others at -inf."""
    out = logits.new_full(logits.shape, float("-inf"))
    out[ids] = logits[ids]
    return out
