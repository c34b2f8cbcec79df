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

A call's input is one line, and where the model would end that line or write it over again, the call ends as the
format ends it, with `<call>`: a newline's probability there goes to the `<`, and a `<` there can only spell
`<call>` (or `<response>`, which the engine reads as the `<call>` it means). Asked "Tell me a joke." the model wrote `<request><Search>laughs at a joke.` and then the same line again
and again, asked "What is the Jargon File?" `<request><Search>jargon_file_jargon_file_jargon_file_`, until the
repetition stop ended the turn with the unfinished call as its answer, which the chat's next question copied.
Once the input ends with a span of MIN_REPEAT or more characters with a letter (and no digit or bracket: a sum's
own repeats) written twice in a row, the next tokens spell `<call>`.

After a look-up (Search's entries, a `term: definition` line each), the answer line begins with the first entry,
the best, whole, as the prompt asks ("A look-up's answer is the definition the tool returned") and every example
answers: with the entry in front of it, the model wrote "Result = what a daemon is" (asked "Explain what a daemon
is."), "Result = A newbie." for "A Usenet neophyte", "metasytactic" for "metasyntactic", and from three entries
none of which was kernel's, "Result = kernel: A fictional society that Linux bigots claim Linux users belong to"
(the first: "kernel-of-the-week club: The fictional society that BSD bigots claim ..."). After a tool's error the
answer line, where the model opens it (rather than another call), begins with that error: asked "What is 10 /
0?", the Calculator said "error: division by zero" and the model answered "Result = 10"; asked "How many seconds
are in a day?", its call failed to parse and it answered "Result = 1 day * 86400 = 1080000000 seconds". What the
model writes after the quoted line stays free.

Where a tool claims the question (`Tool.claims`: a sum written in symbols is the Calculator's), the reply's
tokens spell that call first, `<request><Calculator>2 + 2 * 3<call>`, each one a token whose text goes on with it
(the model picks how it is cut): asked "What is 2 + 2 * 3?" the model sent "2 * 3", and "What is 4 - 6?" it
answered "Result = 4 - 6" with no call.

The tokens each state allows are app.answer_grammar's.
"""

from __future__ import annotations

import re

from app.protocol import ANSWER_PREFIX, CALL, NEXT_QUESTION, REQUEST, RESPONSE, SUBMIT

_TAG = re.compile(r"<([A-Za-z]*)")
_OPEN_TAG = re.compile(r"<([A-Za-z]*)$")
# a call being written: its input so far, and the open tag after it, if any
_CALLING = re.compile(re.escape(REQUEST) + r"<[A-Za-z]+>([^<\n]*)(<[A-Za-z]*)?\Z")
# the tags that end a call (app.engine reads a `<response>` written there as the `<call>` it means)
CALL_ENDS = (CALL, RESPONSE)
_GLUED = re.compile(r"\S<[A-Za-z]*$")  # a `<` right after the answer's text: it ends the line (not "3 < 5")
_END = SUBMIT[1:-1]  # "submit": the one tag the answer line may hold
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
    return owed_allows(written, number, text, numeric=True)


def owed_allows(written: str, owed: str, text: str, numeric: bool) -> bool:
    """Whether the answer line, with `written` after its `Result =`, may take `text` next when it owes `owed` (" " +
    a tool's output): the line begins with it, whole; after it anything (after a number: anything but more of it)."""
    after = written + text
    if owed.startswith(after):
        return True
    return after.startswith(owed) and not (numeric and _goes_on_a_number(after[len(owed):]))


MAX_CALL_LINE = 512  # a longer line is no call these rules follow (Search reads 500 characters of a query)
MIN_REPEAT = 8  # characters of a span that, written twice in a row in a call's input, end the call


_SUM_MARKS = frozenset("0123456789()")


def writes_it_twice(text: str) -> bool:
    """Whether `text` ends with a span of MIN_REPEAT or more characters, with a letter and no digit or bracket,
    written twice in a row ("jargon_file_jargon_file_"; not "1 + 1 + 1 + 1", "sqrt(2) * sqrt(2) * sqrt": a sum's
    own repeats, which a review found cut short)."""
    for size in range(MIN_REPEAT, len(text) // 2 + 1):
        span = text[-size:]
        if text[-2 * size:-size] == span and any(c.isalpha() for c in span) and not _SUM_MARKS.intersection(span):
            return True
    return False


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


def spells_submit(text: str) -> bool:
    """Whether text, which opens with `<`, goes on spelling `<submit>` (up to its `>`) and adds something."""
    return len(text) > 1 and SUBMIT.startswith(text)


def _past_one_newline(head: str) -> str:
    return head[1:] if head.startswith("\n") else head


class AnswerLine:
    """One segment's view of the line the model is writing: whether it is the answer line, and the `<tag` its
    text ends with. Fed the segment's text as it grows; a segment starts on a new line (after the question's
    line or a tool's `<response>`)."""

    def __init__(self, prefix: str = ANSWER_PREFIX, after_tool: bool = False, number: str | None = None,
                 after_question: bool = False, opening: str | None = None, quote: str | None = None):
        self._prefix = prefix
        self._opening_due, self._begun = opening or None, ""  # the text the segment must spell first, and so far
        owed = number if number is not None else quote  # a tool's output the answer line begins with
        self._owed = None if owed is None else " " + owed  # (as the answer writes it)
        self._numeric = number is not None  # (then no more of the number after it)
        # the current line's text, as far as a rule reads it: a call's (MAX_CALL_LINE) or the owed output and a few
        # characters after it; `_long` once the line has gone past that (no call, the owed output long written)
        self._text, self._long = "", False
        self._keep = max(MAX_CALL_LINE, len(prefix) + len(self._owed or "") + 8)
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
    def _opening(self) -> str:
        """The line's first characters: whether it is the answer line."""
        return self._text[: len(self._prefix) + 8]

    @property
    def owed_due(self) -> str | None:
        """While the rule of a tool's output holds, the answer line's text after `Result =` so far: until the
        output is whole, and after a number while what follows may still go on with it ("64." could be 64.5)."""
        if self._owed is None or self._long or not self.on_answer:
            return None
        written = self._text.lstrip()[len(self._prefix):]
        if self._owed.startswith(written):  # (not begun, or begun)
            return written
        whole = self._numeric and written.startswith(self._owed) and _MAY_GO_ON.fullmatch(written[len(self._owed):])
        return written if whole else None  # (whole, and what follows may still go on with it)

    @property
    def owed(self) -> str | None:
        """The tool's output the answer line must begin with (" " + it), if any: the Calculator's number, a
        look-up's best entry, or a tool's error."""
        return self._owed

    @property
    def numeric(self) -> bool:
        """Whether the owed output is the Calculator's number (no more of a number may follow it)."""
        return self._numeric

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

    @property
    def call_input(self) -> str | None:
        """While the line is a call being written (`<request><Tool>`, and after it no `<` but the start of a tag
        that ends it): its input so far."""
        found = self._calling()
        return None if found is None else found[1]

    @property
    def call_closing(self) -> str | None:
        """The start of the tag that ends the call ("<", "<ca", "<resp") the call's line ends with, else None."""
        found = self._calling()
        return None if found is None else found[2]

    def _calling(self) -> re.Match | None:
        text = self._text
        found = _CALLING.search(text) if not self._long and text.startswith(REQUEST) else None
        if found is None or (found[2] is not None and not any(end.startswith(found[2]) for end in CALL_ENDS)):
            return None
        return found

    def copy(self) -> "AnswerLine":
        other = AnswerLine(self._prefix)
        other._end, other._head, other._start = self._end, self._head, self._start
        other._owed, other._numeric, other._keep = self._owed, self._numeric, self._keep
        other._brackets, other._text, other._long = self._brackets, self._text, self._long
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
            self._end = self._text = ""
            self._brackets, self._long = 0, False
            delta = delta.rsplit("\n", 1)[-1]
        if not self._long:
            self._long = len(self._text) + len(delta) > self._keep
            self._text = self._text if self._long else self._text + delta
        for char in delta:  # (a `)` with none open closes nothing: "Result = :)")
            if char in "()":
                self._brackets = self._brackets + 1 if char == "(" else max(0, self._brackets - 1)
        self._end = (self._end + delta)[-len(SUBMIT):]  # long enough for an open `<submit`
