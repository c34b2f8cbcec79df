"""The answer is one line ended by `<submit>`: once the model has begun its `Result = ...` line, it cannot start a
new line, and a `<` it writes there followed by letters can only spell `<submit>`.

The prompt's format writes every answer as one line ended by `<submit>`. A small model often ends a short answer
("Result = Goodbye!") with a newline instead, then writes the next few-shot example ("\\nQ: ..."), or closes it
with the tools' marker (`Result = Good morning!<response>`); the stops catch both, but the answer then ends
without `<submit>`. Masking the tokens that would do either while the model is on its answer line leaves it the
choices the format allows: go on, `<submit>`, or EOS. A `<` not followed by a letter ("3 < 5") stays free.

Where the model would end the answer's line (a newline, once the line holds some answer), the line ends as the
format ends it: the newlines' probability goes to the `<` of `<submit>`, and a `<` right after the answer's text
can only go on to spell `<submit>`. Masking the newline alone left the model to go on writing after the answer it
meant to end, and it sometimes looped ("Result = Thanks, I'm glad you helped me. I'm glad you helped me. ..."
until the repetition stop), or wrote past the definition it had copied. While a bracket the answer opened is
still open, that ending probability goes to `)` instead, and the line cannot end yet: a definition copied from a
tool's output ended "... (which may or may not actually take place<submit>", one `)` short (the model put 0.50
on `<` and 0.40 on `)` and `)<` together).

After a tool's output the model's next line opens its answer or another call (`Result =` or `<request>`, after
at most one newline): a small model sometimes wrote the next example's "\nQ:" right after the `<response>`
("Can you help me?" searched "help"; "Explain the term snippage." got its entry, then wrote nothing), which
ended the turn with no answer at all, shown as "(no text)". Right after the question the model's reply does not
open with "Q:" either: that is the next example's question, which the "\nQ:" stop cannot see there (the newline
before it is the question's, not generated). Asked "meaning of cruft", the model wrote "Q: What is the difference
between a calculator and a calculator?", then a search for luser, and answered with its definition.

After the Calculator's output the answer line begins with that output, as every example in the prompt answers:
the model dropped the sign of a negative result ("5 - 29": the tool said -24, the answer read "Result = 24"; 2 of
3 negative results), once wrote 100 for "4,096 / 64" where the tool said 64, and where only a number it began was
held to the output, wrote "Result = (-150)" or "Result =  –15" (an en dash). Words after the number stay free.

Where a tool claims the question (`Tool.claims`: a sum written in symbols is the Calculator's), the reply's
tokens spell that call first, `<request><Calculator>2 + 2 * 3<call>`, each one a token whose text goes on with it
(the model picks how it is cut): asked "What is 2 + 2 * 3?" the model sent "2 * 3", and "What is 4 - 6?" it
answered "Result = 4 - 6" with no call.

This is a constraint on the next token, like a grammar in serving engines: deterministic, applied in the same
way with the cache on or off and to verified drafts, so greedy output stays a pure function of the token ids.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import TYPE_CHECKING

from app.protocol import ANSWER_PREFIX, CALL, NEXT_QUESTION, QUESTION_PREFIX, REQUEST, RESPONSE, SUBMIT

if TYPE_CHECKING:
    import torch

_TAG = re.compile(r"<([A-Za-z]*)")
_OPEN_TAG = re.compile(r"<([A-Za-z]*)$")
_GLUED = re.compile(r"\S<[A-Za-z]*$")  # a `<` right after the answer's text: it ends the line (not "3 < 5")
_END = SUBMIT[1:-1]  # "submit": the one tag the answer line may hold
# A call and its output, a number alone (the Calculator's: app.tools.numbers.format_number: 943, -24, 0.3, 1.5e20;
# also a sum Search passed on to it, see app.tools.registry.Misrouted), at the end of the ids
_CALCULATED = re.compile(re.escape(REQUEST) + r"<[A-Za-z]+>[^<]*" + re.escape(CALL) + r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"
                         + re.escape(RESPONSE) + r"\Z")
_NUMBER_START = frozenset("0123456789-+.")


def _writes_a_number(text: str) -> bool:
    return text.lstrip()[:1] in _NUMBER_START


# What, right after a number, goes on with it: a digit; a point or comma and a digit; an exponent
_GOES_ON = re.compile(r"\d|[.,]\d|[eE][-+]?\d")
# What, right after a number, may still go on with it ("64." may become 64.5: the rule stays on while it may)
_MAY_GO_ON = re.compile(r"[.,]?|[eE][-+]?")


def _goes_on_a_number(rest: str) -> bool:
    """Whether `rest`, written right after a number, continues it."""
    return _GOES_ON.match(rest) is not None


def number_allows(written: str, number: str, text: str) -> bool:
    """Whether the answer line, with `written` after its `Result =`, may take `text` next when the Calculator gave
    `number` (" " + its output): the line begins with the number, whole; after it, anything but more of a number."""
    after = written + text
    if number.startswith(after):
        return True
    return after.startswith(number) and not _goes_on_a_number(after[len(number):])


def breaks_the_line(text: str) -> bool:
    """Whether text, on the answer line, holds a newline or a `<tag` that is not (the start of) `<submit>`."""
    if "\n" in text:
        return True
    for tag in _TAG.finditer(text):
        name, closed = tag[1], tag.end() < len(text)
        if name and (name != _END if closed else not _END.startswith(name)):
            return True
    return False


OPENINGS = (ANSWER_PREFIX, REQUEST)  # what the line after a tool's output may open with


def opens_well(head: str) -> bool:
    """Whether `head`, the start of a segment after a tool's output, opens (or can still open) the answer or
    another call: at most one newline, then (the start of) `Result =` or `<request>`, and nothing after it that
    breaks that line."""
    rest = _past_one_newline(head)
    for opening in OPENINGS:
        if opening.startswith(rest):
            return True
        if rest.startswith(opening):
            after = rest[len(opening):]
            return not breaks_the_line(after) if opening == ANSWER_PREFIX else "\n" not in after
    return False


def asks_next(start: str) -> bool:
    """Whether `start`, the start of a reply right after the question, opens (or can still open) the next
    example's question: "Q:" (after at most one newline)."""
    opening, question = _past_one_newline(start), NEXT_QUESTION.lstrip("\n")
    return bool(opening) and (question.startswith(opening) or opening.startswith(question))


def _spells_submit(text: str) -> bool:
    """Whether text, which opens with `<`, goes on spelling `<submit>` (up to its `>`) and adds something."""
    return len(text) > 1 and SUBMIT.startswith(text)


def _past_one_newline(head: str) -> str:
    return head[1:] if head.startswith("\n") else head


class AnswerLine:
    """One segment's view of the line the model is writing: whether it is the answer line, and the `<tag` its
    text ends with. Fed the segment's text as it grows; a segment starts on a new line (after the question's
    line or a tool's `<response>`)."""

    def __init__(self, prefix: str = ANSWER_PREFIX, after_tool: bool = False, number: str | None = None,
                 after_question: bool = False, opening: str | None = None):
        self._prefix = prefix
        self._opening_due, self._begun = opening or None, ""  # the text the segment must spell first, and so far
        self._number = None if number is None else " " + number  # the Calculator's output, as the answer writes it
        self._line = ""  # the current line, while `number` may still be due on it
        self._opening = ""  # the line's first characters: whether it is the answer line
        self._end = ""  # its last characters: an open `<tag`
        self._brackets = 0  # round brackets the line has opened and not closed
        # after a tool's output: the segment's text until it opens the answer or a call (None: no such rule now)
        self._head: str | None = "" if after_tool else None
        # right after the question: the reply's text until it holds more than a newline (None: no such rule now)
        self._start: str | None = "" if after_question else None

    @property
    def opening_due(self) -> str | None:
        """What the segment must still spell of its opening (a claimed tool call), else None."""
        due = self._opening_due
        if due is None or len(self._begun) >= len(due) or not due.startswith(self._begun):
            return None
        return due[len(self._begun):]

    @property
    def head(self) -> str | None:
        """The segment's text so far while its first line must still open the answer or a call, else None."""
        return self._head

    @property
    def start(self) -> str | None:
        """The reply's text so far while it is right after the question and holds no more than a newline."""
        return self._start

    @property
    def on_answer(self) -> bool:
        """Whether the answer line's grammar applies now: the current line opens with the answer prefix."""
        return self._opening.lstrip().startswith(self._prefix)

    @property
    def number_due(self) -> str | None:
        """While the number's rule holds, the answer line's text after `Result =` so far: until the Calculator's
        number is whole, and after it while what follows may still go on with it ("64." could be 64.5)."""
        if self._number is None or not self.on_answer:
            return None
        written = self._line.lstrip()[len(self._prefix):]
        if self._number.startswith(written):  # (not begun, or begun)
            return written
        whole = written.startswith(self._number) and _MAY_GO_ON.fullmatch(written[len(self._number):])
        return written if whole else None  # (whole, and what follows may still go on with it)

    @property
    def number(self) -> str | None:
        """The Calculator's output the answer line must write as its number (" " + it), if any."""
        return self._number

    @property
    def can_end(self) -> bool:
        """Whether the line is the answer line with some answer on it, outside a `<tag`: where a newline the model
        writes ends the answer (AnswerGrammar.mask)."""
        return self.on_answer and bool(self._opening.lstrip()[len(self._prefix):].strip()) and self.open_tag is None

    @property
    def owes_bracket(self) -> bool:
        """Whether the line has opened a round bracket it has not closed: an answer does not end there."""
        return self._brackets > 0

    @property
    def glued_tag(self) -> bool:
        """Whether the line ends with an open `<tag` written right after its text (no space before the `<`)."""
        return _GLUED.search(self._end) is not None

    @property
    def open_tag(self) -> str | None:
        """The letters after a `<` the line ends with ("" right after the `<`), else None."""
        found = _OPEN_TAG.search(self._end)
        return None if found is None else found[1]

    def copy(self) -> "AnswerLine":
        other = AnswerLine(self._prefix)
        other._opening, other._end, other._head, other._start = self._opening, self._end, self._head, self._start
        other._number, other._line = self._number, self._line
        other._brackets = self._brackets
        other._opening_due, other._begun = self._opening_due, self._begun
        return other

    def push(self, delta: str) -> None:
        if self.opening_due is not None:
            self._begun += delta
        if self._start is not None:
            self._start += delta
            if _past_one_newline(self._start):
                self._start = None  # begun: not the next question (the ban saw to it)
        if self._head is not None:
            self._head += delta
            if _past_one_newline(self._head).startswith(OPENINGS):
                self._head = None  # opened: the answer line's own rules (or none, in a call) from here
        if "\n" in delta:
            self._opening = self._end = self._line = ""
            self._brackets = 0
            delta = delta.rsplit("\n", 1)[-1]
        if self._number is not None and len(self._line) < len(self._prefix) + len(self._number) + 8:
            self._line += delta  # (only as long as the number's rule needs it)
        for char in delta:  # (a `)` with none open closes nothing: "Result = :)")
            if char in "()":
                self._brackets = self._brackets + 1 if char == "(" else max(0, self._brackets - 1)
        self._opening = (self._opening + delta)[: len(self._prefix) + 8]
        self._end = (self._end + delta)[-len(SUBMIT):]  # long enough for an open `<submit`


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
        # (rule, its state) -> the ids it bans; a handful of states, each computed once
        self._banned: dict[tuple, torch.Tensor | None] = {}

    def text(self, token: int) -> str:
        """A token's text, as decoded once here (no tokenizer call, so no lock)."""
        return self._texts[token]

    def calculated(self, ids: list[int]) -> str | None:
        """The Calculator's output when these ids end with its call and output (the number the answer writes)."""
        found = _CALCULATED.search("".join(self._texts[i] for i in ids[-64:]))
        return found[1] if found else None

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
            return self._ban(("glued", state), lambda text: not _spells_submit("<" + state + text))
        tag = "" if state is None else "<" + state
        banned = self._ban(("answer", state), lambda text: breaks_the_line(tag + text))
        written, number = line.number_due, line.number
        if number is None or written is None or not written.startswith(number) or state is not None:
            return banned  # (the number not yet whole: allowed(), not a ban)
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
        """Until the answer line has written the Calculator's number whole, the only tokens it may take (those that
        go on with it, or end it): a few ids, so a row's mask keeps them rather than banning the whole vocabulary
        (which cost 20 chats at once ~1 s a turn)."""
        written, number = line.number_due, line.number
        if written is None or written.startswith(number) or line.open_tag is not None:
            return None
        key = ("allowed", number, written)
        if key not in self._banned:
            import torch

            self._forget_numbers()
            rest = number[len(written):]
            # (the tokens that are a part of it exactly: looked up, not scanned; the first part is often " ", the
            # start of ~32,000 tokens' texts: 13 ms a new number, in the scheduler's thread)
            allowed = self._parts(rest, len(rest) - 1)
            allowed += [i for i in self._starting(rest) if number_allows(written, number, self._texts[i])]
            self._banned[key] = torch.tensor(sorted(allowed), dtype=torch.long)
        return self._banned[key]

    def _spelling(self, rest: str) -> torch.Tensor | None:
        """The tokens that spell the next part of `rest` (each token is a prefix of it; the model picks how it is
        cut); None where no token does (no constraint rather than no token at all)."""
        key = ("opening", rest)
        if key not in self._banned:
            import torch

            self._forget_numbers()
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

    def _forget_numbers(self) -> None:
        """Bound the cache: each Calculator result adds a few states (a few hundred results at most are kept)."""
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


def _keep(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `ids` alone, the others at -inf."""
    out = logits.new_full(logits.shape, float("-inf"))
    out[ids] = logits[ids]
    return out
