"""What the engine needs from whatever runs the model: one call per model segment.

Two backends implement it: app.backends.local (the model in this process, forward passes on the session's
TokenCache) and app.backends.server (a serving engine over HTTP: llama.cpp's server or vLLM). The engine keeps
the turn loop, the tools and the events; a backend appends the segment's tokens to the session's ids (the
ground truth either way) and records why the segment stopped, from the code or server that stopped it.
`MODEL_SERVER_URL` chooses the server backend (see load_backend).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from app.episode import Provenance, Stop

if TYPE_CHECKING:
    import torch

    from app.model.kvcache import TokenCache
    from app.settings import Settings


class BackendError(ValueError):
    """The model server failed (down, slow, an HTTP error, malformed data), or the model could not be loaded: a
    clear message for the page, the API and the CLI, never a traceback. The engine rolls the failed segment back,
    so the session stays usable. A ValueError like InputError, so every boundary that shows user-facing errors
    shows this one too."""


@dataclass
class SegmentRun:
    """What one model segment did, filled in by the backend as it goes, so that a segment cut short by Stop or
    an error still says what it did."""

    stop: Stop | None = None
    # given by the engine: the protocol's stop strings (a string match among them ends the segment, as EOS does)
    stop_strings: tuple[str, ...] = ()
    # given by the engine: special tokens that are the protocol's markers, text of the segment (segment_text)
    shown: frozenset[int] = frozenset()
    prefill_tokens: int | None = 0  # tokens fed through the model as new input; None: the server did not say
    cached_tokens: int | None = 0  # tokens whose keys/values came from a cache; None: the server did not say
    generated_tokens: int = 0  # tokens the model chose
    # given by the engine: the GBNF grammar the segment's tokens follow (app.decoding.guide), None with the guide off
    grammar: str | None = None
    # with a grammar: who chose each token the segment added (app.episode.Provenance), filled in by the backend
    provenance: list[Provenance] | None = None
    steered_known: bool = True  # False where the backend cannot tell a steered token from the model's own
    # given by the engine as [] where Settings.logprobs asks: each added token's log-probability under the logits it
    # was sampled from (app.decoding.sampling.token_logprobs), 0.0 for a token the guide forced; filled by the backend
    logprobs: list[float] | None = None


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
        together (app.model.scheduler.Scheduler.turn)."""

    def run_segment(self, cache: TokenCache, settings: Settings, cancel: threading.Event | None,
                    run: SegmentRun, generator: torch.Generator) -> Iterator[str]:
        """Generate one model segment after `cache.ids`, appending its tokens to them and yielding text deltas;
        `run` records the stop and the counts. Precondition: `len(cache) < settings.max_length`. On an error the
        segment's tokens are rolled back, `run.stop` says ERROR, and the error propagates."""
