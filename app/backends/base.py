"""What the engine needs from whatever runs the model: one call per model segment.

Two backends implement it: app.backends.local (the model in this process, forward passes on the session's
TokenCache) and app.backends.server (a serving engine over HTTP: llama.cpp's server or vLLM). The engine keeps
the turn loop, the tools and the events; a backend appends the segment's tokens to the session's ids (the
ground truth either way) and records why the segment stopped, from the code or server that stopped it.
`MODEL_SERVER_URL` chooses the server backend (see load_backend).
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from app.episode import Segment

if TYPE_CHECKING:
    import torch

    from app.model.kvcache import TokenCache
    from app.settings import Settings


class BackendError(ValueError):
    """The model server failed (down, slow, an HTTP error, malformed data), or the model could not be loaded: a
    clear message for the page, the API and the CLI, never a traceback. The engine rolls the failed segment back,
    so the session stays usable. A ValueError like InputError, so every boundary that shows user-facing errors
    shows this one too."""


@dataclass(frozen=True)
class SegmentRequest:
    """What the engine asks of one model segment beside the settings: the protocol's stop strings (a string match
    among them ends the segment, as EOS does) and its markers (special tokens shown as the segment's text,
    segment_text), the guide's forced opening ids and its GBNF grammar of what follows them (app.decoding.guide;
    none with the guide off), and whether to record each token's log-probability (Settings.logprobs)."""

    stop_strings: tuple[str, ...] = ()
    shown: frozenset[int] = frozenset()
    grammar: str | None = None
    logprobs: bool = False
    forced: tuple[int, ...] = ()  # the segment's first tokens, written as the guide's forced ones (a claimed call)

    @property
    def guided(self) -> bool:
        """Whether the guide decides any token (each token's provenance is then recorded)."""
        return self.grammar is not None or bool(self.forced)

    def blank(self) -> Segment:
        """The model segment a backend fills as it runs (its Generation fields; the engine places it at the end):
        who chose each token where the guide takes part, and the tokens' log-probabilities where asked
        (app.decoding.sampling.token_logprobs; 0.0 for a forced token)."""
        return Segment("model", "", 0, 0, provenance=[] if self.guided else None,
                       logprobs=[] if self.logprobs else None)


class SegmentStream:
    """One model segment as it runs, as the backend returns it: `deltas`, its text as it comes, and `result()`, the
    record of what it did, once `deltas` is over (read to its end, closed, or failed), so that a segment cut short
    by Stop or an error still says what it did. Until then the record is the backend's, and asking is an error."""

    __slots__ = ("deltas", "_record")

    def __init__(self, deltas: Generator[str, None, None], record: Segment):
        self.deltas, self._record = deltas, record

    def result(self) -> Segment:
        if self.deltas.gi_frame is not None:  # (a generator's frame is gone once it returned, raised or was closed)
            raise RuntimeError("a segment's result is read once its deltas are over")
        return self._record


@dataclass(frozen=True)
class BackendStats:
    """What the stats panel and `/stats` show of a backend: its name, where the keys/values live, what runs the
    model, and (in process) how many rows the scheduler batched into its steps."""

    name: str
    kv_in_process: bool
    runs: str | None = None  # what computes the passes (in process: the batched pass, or the model's own forward)
    steps: int | None = None  # the scheduler's steps so far (None: a model server schedules its own)
    rows: int = 0  # row-steps: rows / steps is the mean batch
    peak_rows: int = 0
    adapter: str | None = None  # the LoRA adapter merged into the weights, and the run that trained it (None: base)


class Backend(Protocol):
    """A model behind one small interface. `lock` serializes tokenizer use (fast tokenizers are not
    thread-safe)."""

    name: str  # which backend answers: shown in the stats panel and the CLI's / API's JSON
    tokenizer: object
    lock: threading.RLock
    context_limit: int  # the most tokens a session may hold (the model's or the server's context)
    parallel: int  # how many segments it usefully runs at once (a batch's rows run this many at a time)
    shares_prefix: bool  # sessions read the prefilled prompt's keys/values in place, not a copy (app.model.kvcache)
    special_token_texts: list[str]
    kv_in_process: bool  # the sessions' keys/values live in this process (in its memory budget), not on a server
    kv_bytes_per_token: int  # what one token's keys/values take in this process (0 where they live on a server)
    tuned_for: str | None  # the protocol the weights were tuned for (a LoRA adapter's), which `auto` chooses

    def stats(self) -> BackendStats:
        """The backend's figures for the stats panel and `/stats`."""

    def prefill(self, cache: TokenCache) -> None:
        """Compute a shared system prompt's keys/values once, where this process holds them."""

    def prefill_rest(self, cache: TokenCache) -> None:
        """Compute the keys/values of `cache`'s uncached ids (a group's question, app.engine.groups) before it is
        forked, where this process holds them; a model server caches the prefix itself (nothing to do)."""

    def turn_scope(self) -> AbstractContextManager[None]:
        """Brackets one turn, from its question to its answer (tool runs included): in process, the model's next
        step waits a moment for a turn that is about to ask for a pass, so turns that start together prefill
        together (app.backends.scheduler.Scheduler.turn)."""

    def run_segment(self, cache: TokenCache, settings: Settings, cancel: threading.Event | None,
                    request: SegmentRequest, generator: torch.Generator) -> SegmentStream:
        """Generate one model segment after `cache.ids`, appending its tokens to them: its text deltas and what it
        did (SegmentStream). Precondition: `len(cache) < settings.max_length`. On an error the segment's tokens are
        rolled back, its record's stop says ERROR, and the error propagates from the deltas."""
