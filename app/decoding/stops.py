"""Per-token decisions: what text a token adds and whether (and why) the segment stops. The stop reason is recorded by
the code that stops, never guessed from the text afterwards; every check is O(1) in the segment's length."""

from __future__ import annotations

import bisect

from app.episode import Limit, Stop, StopReason


def segment_text(tokenizer, ids: list[int], shown: frozenset[int] = frozenset()) -> str:
    """A model segment's text: special tokens left out (EOS, the template's own) except `shown`, a protocol's
    markers where the tokenizer has them as special tokens (Qwen's `<tool_call>`), which are the segment's text."""
    if not shown.intersection(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    hidden = set(tokenizer.all_special_ids) - shown
    return tokenizer.decode([i for i in ids if i not in hidden], skip_special_tokens=False)


class Detokenizer:
    """Turns generated token ids into text deltas (segment_text), decoding only the tokens since the last emitted text,
    and holds a delta back while it ends in an incomplete UTF-8 character."""

    def __init__(self, tokenizer, shown: frozenset[int] = frozenset()):
        self._tokenizer, self._shown = tokenizer, shown
        self._ids: list[int] = []
        self._prefix = 0  # window start: decoding from here keeps word-boundary spaces right
        self._read = 0  # ids before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return segment_text(self._tokenizer, ids, self._shown)

    def copy(self) -> "Detokenizer":
        """One that goes on from here on its own (what drafts would read as: app.decoding.choose)."""
        other = Detokenizer(self._tokenizer, self._shown)
        other._ids, other._prefix, other._read = self._ids[self._prefix:], 0, self._read - self._prefix
        return other

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]


LOOP_PERIODS = range(4, 21)  # token lengths of a repeated span that count as a loop (of 2+ distinct tokens:
# "1000000000000" repeats one digit token, and is an answer)
LOOP_COPIES = 3


class StopChecker:
    """Decides after every generated token whether the segment stops, and why. Precedence: a stop string over EOS over
    the length limits, the session's max_length over max_new_tokens; a stop string ending inside a token keeps that
    token whole."""

    def __init__(self, stop_strings: tuple[str, ...], eos_ids: frozenset[int]):
        self.stop_strings = stop_strings
        self.eos_ids = eos_ids
        self._keep = max((len(s) for s in stop_strings), default=1) - 1

    def start(self) -> "StopScan":
        return StopScan(self)


class StopScan:
    """One segment's running state for a StopChecker: only a short tail of the text seen so far."""

    def __init__(self, checker: StopChecker):
        self._checker = checker
        self._tail = ""
        self._recent: list[int] = []  # the last LOOP_COPIES * LOOP_PERIODS[-1] generated ids

    def check(self, token_id: int, delta: str, generated: int, max_new_tokens: int,
              total: int, max_length: int) -> Stop | None:
        found = self._match(delta)
        if found is not None:
            return Stop(StopReason.STRING_MATCH, string=found)
        if token_id in self._checker.eos_ids:
            return Stop(StopReason.EOS)
        if total >= max_length:
            return Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_LENGTH)
        if generated >= max_new_tokens:
            return Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_NEW_TOKENS)
        if self._loops(token_id):
            return Stop(StopReason.REPETITION)
        return None

    def _loops(self, token_id: int) -> bool:
        """Whether the last tokens are one span of 4-20 tokens written LOOP_COPIES times in a row, a loop greedy
        decoding never leaves."""
        recent = self._recent
        recent.append(token_id)
        del recent[: -LOOP_COPIES * LOOP_PERIODS[-1]]
        for period in LOOP_PERIODS:
            if len(recent) < LOOP_COPIES * period:
                break
            last = recent[-period:]
            copies = (recent[-(k + 1) * period: len(recent) - k * period] for k in range(1, LOOP_COPIES))
            if len(set(last)) > 1 and all(copy == last for copy in copies):
                return True
        return False

    def _match(self, delta: str) -> str | None:
        """The stop string completed by this delta that ends first (a match must end inside the delta)."""
        if not delta:
            return None
        text = self._tail + delta
        best, best_end = None, None
        for s in self._checker.stop_strings:
            at = text.find(s, max(0, len(self._tail) - len(s) + 1))
            if at >= 0 and (best_end is None or at + len(s) < best_end):
                best, best_end = s, at + len(s)
        keep = self._checker._keep
        self._tail = text[-keep:] if keep else ""
        return best


class Holdback:
    """Streams a segment's text but withholds a tail that may be (the start of) a stop string that is not kept
    (a trailing "\\n" may begin "\\nQ:"), so a view never shows text that the segment then drops."""

    def __init__(self, cut_strings: frozenset[str] | tuple[str, ...]):
        self._prefixes = sorted({s[:i] for s in cut_strings for i in range(1, len(s) + 1)}, key=len, reverse=True)
        self._text = ""  # the segment's text so far
        self._shown = 0

    def push(self, delta: str) -> str:
        """Add text; return what can be shown now."""
        self._text += delta
        held = next((len(p) for p in self._prefixes if self._text.endswith(p)), 0)
        return self._show(len(self._text) - held)

    def close(self, end: int | None = None) -> str:
        """The segment ended: return the rest to show, up to character `end` (None: all of it)."""
        return self._show(len(self._text) if end is None else end)

    def _show(self, end: int) -> str:
        out = self._text[self._shown:end]
        self._shown = max(self._shown, end)
        return out


def tokens_before(ends: list[int], at: int) -> int:
    """How many tokens keep all text before character `at`, whole tokens only (`ends[i]`: where token i's text
    ends): the tokens that end by `at`, plus the one that straddles it."""
    keep = bisect.bisect_right(ends, at)
    if keep < len(ends) and (ends[keep - 1] if keep else 0) < at:
        keep += 1
    return keep
