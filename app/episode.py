"""The records of a turn: why a segment stopped, segments (model or tool), the episode that holds them, and the events
a turn yields.

Plain data, serialized the same way everywhere (the CLI's JSON, the API, the page's views).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

class StopReason(str, enum.Enum):
    STRING_MATCH = "string_match"
    EOS = "eos"
    MAX_LENGTH = "max_length"
    REPETITION = "repetition"  # the last tokens were one span written three times over: a loop, not an answer
    CANCELLED = "cancelled"  # the user stopped it (or the stream was closed)
    ERROR = "error"  # the model raised; the session was rolled back to its last consistent state


class Limit(str, enum.Enum):
    MAX_NEW_TOKENS = "max_new_tokens"  # this segment's budget
    MAX_LENGTH = "max_length"  # the whole session's token budget


@dataclass(frozen=True)
class Stop:
    reason: StopReason
    string: str | None = None
    limit: Limit | None = None

    @property
    def shown_string(self) -> str | None:
        """The stop string as a view prints it: a newline in it as `\\n` (`\\nQ:`)."""
        return None if self.string is None else self.string.replace("\n", "\\n")

    @property
    def label(self) -> str:
        """The stop reason in the words every view uses: `string match <call>`, `EOS`, `max_length (...)`."""
        if self.reason is StopReason.STRING_MATCH:
            return f"string match {self.shown_string}"
        if self.reason is StopReason.EOS:
            return "EOS"
        if self.reason is StopReason.MAX_LENGTH:
            return "max_length (max_new_tokens)" if self.limit is Limit.MAX_NEW_TOKENS else "max_length (session max_length)"
        if self.reason is StopReason.REPETITION:
            return "repetition"
        return "stopped by user" if self.reason is StopReason.CANCELLED else "error"


class Provenance(str, enum.Enum):
    """Who chose a model segment's token (app.decoding.guide)."""

    MODEL = "model"  # the model's own choice
    STEERED = "steered"  # the guide removed the token the model ranked first
    FORCED = "forced"  # the guide's: its opening (a claimed call), or the only text the grammar allowed


@dataclass(kw_only=True)
class Generation:
    """What a model wrote in one segment: why it stopped, its counts, who chose each token; the fields a backend
    fills in a model Segment (a tool segment's stay zero)."""

    stop: Stop | None = None  # why a model segment stopped; a tool segment's: max_length where its output was cut
    prefill_tokens: int | None = 0  # tokens fed through the model as new input at the segment's start
    cached_tokens: int | None = 0  # tokens whose keys/values came from the cache (None: a server did not say)
    generated_tokens: int = 0  # tokens the model chose (forced ones are the guide's)
    # a model segment's tokens, each with who chose it; None: the guide was off (every token the model's)
    provenance: list[Provenance] | None = None
    steered_known: bool = True  # False where a model server does not say whether its grammar steered a token
    # a model segment's tokens' log-probabilities (Settings.logprobs; 0.0 for forced ones); None: not recorded
    logprobs: list[float] | None = None


@dataclass
class Segment(Generation):
    """One model segment (generated) or tool segment (inserted), with its span in the session's ids."""

    kind: Literal["model", "tool"]
    text: str
    start: int
    end: int
    tool: str | None = None  # tool segments only: the tool the model called
    query: str | None = None
    ok: bool = True
    result: str | None = None  # tool segments: the tool's output as the model reads it (neutralized, bounded)
    ms: float = 0.0

    def place(self, text: str, start: int, end: int, ms: float) -> Segment:
        """A model segment the backend has filled, given its place, text and time once it is over; its per-token
        records keep the tokens it kept (`end - start`: the engine may have cut a stop string off)."""
        self.text, self.start, self.end, self.ms = text, start, end, ms
        kept = end - start
        if self.provenance is not None:
            del self.provenance[kept:]
        if self.logprobs is not None:
            del self.logprobs[kept:]
        return self

    @property
    def forced_tokens(self) -> int:
        return sum(p is Provenance.FORCED for p in self.provenance or ())

    @property
    def steered_tokens(self) -> int | None:
        """Tokens the guide steered; None where a model server cannot say."""
        if not self.steered_known:
            return None
        return sum(p is Provenance.STEERED for p in self.provenance or ())

    @property
    def guided_label(self) -> str:
        """"guided: 9 forced, 2 steered" ("" where the guide changed nothing that is known, or was off)."""
        forced, steered = self.forced_tokens, self.steered_tokens
        if not forced and not steered:
            return ""
        parts = ([f"{forced} forced"] if forced else []) + ([f"{steered} steered"] if steered else [])
        return "guided: " + ", ".join(parts + (["steered not reported"] if steered is None else []))

    def token_provenance(self) -> list[Provenance]:
        """Who chose each of the segment's tokens (a tool segment's: none, []; the guide off: the model)."""
        if self.kind != "model":
            return []
        return list(self.provenance) if self.provenance is not None else [Provenance.MODEL] * (self.end - self.start)

    def to_json(self) -> dict:
        stop = self.stop
        return {
            "kind": self.kind,
            "text": self.text,
            "stop_reason": stop.reason.value if stop else None,
            "stop_string": stop.string if stop else None,
            "limit": stop.limit.value if stop and stop.limit else None,
            "tool": self.tool,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "ms": round(self.ms, 3),
            # (every model segment says it, the guide off too: one schema whatever the settings)
            **({"guided": {"forced_tokens": self.forced_tokens, "steered_tokens": self.steered_tokens}}
               if self.kind == "model" else {}),
        }


@dataclass
class Episode:
    """One question and everything that answered it."""

    question: str
    query_start: int
    query_end: int
    use_cache: bool
    backend: str = ""  # which backend answered (Backend.name)
    segments: list[Segment] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # this turn's tokens: query + segments
    total_tokens: int = 0  # every token of the session when the episode ended
    ms: float = 0.0
    reward: float | None = None
    finished: bool = False
    error: str | None = None  # why the turn failed (the model or its server raised), when it did
    unrun_call: bool = False  # the answer ended with a tool call that max_turns left unrun
    guide: bool = False  # whether the guide (app.decoding.guide) shaped the model segments
    protocol: str = ""  # how model and tools talked (app.protocols: textenv or chat)
    answered: bool = False  # the model ended its answer itself: EOS, or the protocol's end (textenv's `<submit>`)

    UNRUN_NOTE = "the last tool call was not run: max_turns (tool calls per answer) was reached"

    @property
    def model_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "model"]

    @property
    def last_model_segment(self) -> Segment | None:
        return next((s for s in reversed(self.segments) if s.kind == "model"), None)

    @property
    def answer(self) -> str:
        """The last model segment's text, cut at the stop string that ended it."""
        last = self.last_model_segment
        if last is None:
            return ""
        text = last.text
        if last.stop and last.stop.string and last.stop.string in text:
            text = text[: text.rfind(last.stop.string)]
        return text.strip()

    @property
    def stop(self) -> Stop | None:
        last = self.last_model_segment
        return last.stop if last else None

    @property
    def cut_short(self) -> bool:
        """Stop ended the turn (a cancelled segment is always its last: nothing runs after it)."""
        return self.stop is not None and self.stop.reason is StopReason.CANCELLED

    @property
    def prefill_tokens(self) -> int | None:
        """Tokens prefilled over the episode; None when a model server did not report a segment's."""
        return total_or_none(s.prefill_tokens for s in self.segments)

    @property
    def reused_tokens(self) -> int | None:
        return total_or_none(s.cached_tokens for s in self.segments)

    @property
    def provenance(self) -> list[str]:
        """Who wrote each of token_ids: "user" (the question), "tool", or a model token's Provenance value
        ("model", "steered", "forced")."""
        out = ["user"] * (self.query_end - self.query_start)
        for s in self.segments:
            out += ["tool"] * (s.end - s.start) if s.kind == "tool" else [p.value for p in s.token_provenance()]
        return out[: len(self.token_ids)]

    @property
    def mask(self) -> list[int]:
        """TRL's mask over token_ids: 1 for tokens the policy chose (steered ones too), 0 for inserted or forced."""
        return [int(p in ("model", "steered")) for p in self.provenance]

    @property
    def logprobs(self) -> list[float]:
        """Each of token_ids' log-probability under the logits it was sampled from (Settings.logprobs), as `mask`
        lines up: 0.0 for the question, tool output, forced tokens and a segment that recorded none."""
        out = [0.0] * (self.query_end - self.query_start)
        for s in self.segments:
            given = (s.logprobs or [])[: s.end - s.start]
            out += given + [0.0] * (s.end - s.start - len(given))
        return out[: len(self.token_ids)]

    def to_json(self) -> dict:
        return {
            "question": self.question,
            "answer": self.answer,
            "backend": self.backend,
            "protocol": self.protocol,
            "total_tokens": self.total_tokens,
            "cache": {"enabled": self.use_cache, "prefill_tokens": self.prefill_tokens,
                      "reused_tokens": self.reused_tokens},
            "guide": self.guide,
            "segments": [s.to_json() for s in self.segments],
            **({"error": self.error} if self.error else {}),
            **({"unrun_call": self.UNRUN_NOTE} if self.unrun_call else {}),
        }


# Events, in the order a turn yields them. `row`: the turn's place among many run at once (app.engine.rows), set
# by that runner; 0 for a turn alone.
@dataclass(frozen=True)
class SegmentStarted:
    kind: Literal["model", "tool"]
    row: int = 0


@dataclass(frozen=True)
class TextDelta:
    text: str
    row: int = 0


@dataclass(frozen=True)
class SegmentFinished:
    segment: Segment
    row: int = 0


@dataclass(frozen=True)
class EpisodeFinished:
    episode: Episode
    row: int = 0


Event = SegmentStarted | TextDelta | SegmentFinished | EpisodeFinished


def in_row_order(events: Iterator[Event]) -> Iterator[Event]:
    """A batch's interleaved events as if its rows ran one after another: row 0's pass through at once, each
    later row's wait until every row before it has finished."""
    waiting: dict[int, list[Event]] = {}
    finished: set[int] = set()
    current = 0
    for event in events:
        if event.row != current:
            waiting.setdefault(event.row, []).append(event)
        else:
            yield event
        if isinstance(event, EpisodeFinished):
            finished.add(event.row)
        while current in finished:
            current += 1
            yield from waiting.pop(current, [])
    for row in sorted(waiting):
        yield from waiting[row]


@dataclass(frozen=True)
class Span:
    role: Literal["system", "user", "model", "tool"]
    start: int
    end: int


def count_text(n: int | None) -> str:
    """A token count, or "not reported" where a model server did not report it (never a made-up number)."""
    return "not reported" if n is None else str(n)


def total_or_none(counts: Iterable[int | None]) -> int | None:
    """A sum that stays None ("not reported") when any part is None."""
    total = 0
    for n in counts:
        if n is None:
            return None
        total += n
    return total
