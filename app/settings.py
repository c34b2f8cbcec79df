"""What a user sets and writes, checked: the turn's Settings, the question, InputError for a mistake. Standard library
only, so the CLI can check its arguments without importing the model stack."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

MAX_QUESTION_CHARS = 4000
DEFAULT_MAX_LENGTH = 4096  # a session's token budget where none is given, unless the backend's context is shorter
MIN_TEMPERATURE = 0.01  # below it sampling is greedy in all but name, and tiny values overflow logits / temperature
# how model and tools talk (app.protocols): auto picks chat where the model's own chat template renders tools
PROTOCOLS = ("auto", "textenv", "chat")


def default_protocol() -> str:
    """The protocol where none is given: the PROTOCOL environment variable, else auto."""
    return os.environ.get("PROTOCOL", "").strip().lower() or "auto"


class InputError(ValueError):
    """A user mistake (empty message, full context, bad setting): shown as a message, never a traceback."""


@dataclass(frozen=True)
class Settings:
    """Generation parameters of one turn. Frozen: a change is a new value, never a mutation of shared config."""

    max_new_tokens: int = 64  # per model segment
    # token budget of the whole session (prompt + history + this turn); None: the default for the backend, resolved
    # by validated() (DEFAULT_MAX_LENGTH or the backend's context, the smaller)
    max_length: int | None = None
    max_turns: int = 4  # tool calls per answer
    max_tool_response: int = 400  # characters of tool output the model reads
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # sample from the k most likely tokens only (0 = all)
    use_cache: bool = True
    seed: int = 0
    draft_tokens: int = 0  # greedy only: tokens proposed by prompt lookup and verified in one pass (0 = off)
    guide: bool = False  # guided answers (app.decoding.guide): a grammar per segment, every token it decides shown as such
    protocol: str | None = None  # one of PROTOCOLS; None: default_protocol() (chosen by validated())
    logprobs: bool = False  # record each model token's log-probability (Segment.logprobs; a trainer's rollouts)

    def validated(self, context_limit: int, default_max_length: int = DEFAULT_MAX_LENGTH) -> "Settings":
        """These settings for a backend that holds `context_limit` tokens a session, or InputError for the first
        mistake. A missing max_length becomes the smaller of `default_max_length` and that context; one above the
        context is refused."""
        if self.protocol is None:
            return replace(self, protocol=default_protocol()).validated(context_limit, default_max_length)
        if self.max_length is None:
            return replace(self, max_length=min(default_max_length, context_limit)).validated(context_limit)
        checks = [
            (1 <= self.max_new_tokens <= 4096, "max_new_tokens must be between 1 and 4096"),
            (1 <= self.max_length <= context_limit, f"max_length must be between 1 and {context_limit}"),
            (0 <= self.max_turns <= 32, "max_turns must be between 0 and 32"),
            (1 <= self.max_tool_response <= 20000, "max_tool_response must be between 1 and 20000"),
            (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 5,
             f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and 5"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.top_k <= 1_000_000, "top_k must be between 0 (off) and 1000000"),
            (0 <= self.draft_tokens <= 32, "draft_tokens must be between 0 and 32"),
            (0 <= self.seed < 2**63, "seed must be between 0 and 2**63 - 1"),
            (isinstance(self.guide, bool), "guide must be true or false"),
            (self.protocol in PROTOCOLS, f"protocol must be one of {', '.join(PROTOCOLS)} (got {self.protocol!r})"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)
        return self


def require_utf8(text: str, what: str) -> str:
    """Text the tokenizer can take: lone surrogates (a JSON "\\ud800") would make it raise a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{what} is not valid UTF-8 text") from None
    return text


def clean_question(question: str) -> str:
    """The question as the engine takes it, or a clear InputError."""
    if not isinstance(question, str):
        raise InputError("the message must be text")
    question = require_utf8(question, "the message").strip()
    if not question:
        raise InputError("the message is empty")
    if len(question) > MAX_QUESTION_CHARS:
        raise InputError(f"the message is too long ({len(question)} characters, at most {MAX_QUESTION_CHARS})")
    return question
