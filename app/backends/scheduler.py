"""The one owner of the model's forward passes: every session's pending tokens go through one pass per step.

Continuous batching as serving engines do it, kept small: a session's thread (a chat turn, an API call, a batch
row) asks for passes over its uncached tokens; the scheduler's thread takes every waiting request at a step
boundary and runs them as one ragged pass (app.model.ragged), so rows join when they ask and leave when their segment
stops, each with its own settings, sampling generator, stop checker and cancel. A decoding request carries its row
(app.backends.row.Row), which the scheduler updates from each pass's result right after it, in this thread: the
row's per-token work (its tokens, their text, the stop check, the next drafts) runs here and gives back plain data,
the text for the request's output queue and the next pass's keep; the segment's own thread only streams that text.
A request ends in one place (`_finish`). Tools run in the session's thread, never on the model's.

A long prefill (a new question over an evicted history, a long tool result) is fed in chunks while other rows
are decoding, so it never stalls them for much more than one decode step. A row whose pass raises is retried
alone, so a failure is recorded on that row only. Models the ragged pass does not support (`ragged.supports`)
still go through here, one row at a time.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from app.backends.row import Row
from app.model import ragged
from app.model.kvcache import TokenCache
from app.threads import model_threads, use_model_threads

log = logging.getLogger(__name__)

MAX_ROWS = 32  # rows per step (and in-process turns at once): more wait for a row to leave
CHUNK_BESIDE_DECODE = 64  # prefill tokens per step while other rows decode (~ one batched decode step's work)
CHUNK_ALONE = 512  # prefill tokens per step when no row is decoding (bounds a pass's activation memory)
GATHER_S = 0.02  # how long a step waits for rows still choosing their last token (a fraction of a step)


class Cancelled(Exception):
    """A request's cancel was set before its pass was done: a long prefill stops between two chunks, so Stop is
    quick. The cache keeps the chunks fed so far (an exact prefix, as after any pass)."""

    def __init__(self, fed: int, reused: int):
        super().__init__(f"cancelled after {fed} tokens")
        self.fed, self.reused = fed, reused


@dataclass(eq=False)
class Pass:
    """A request for passes over a TokenCache's uncached ids (Scheduler.submit): one, or with a row one a step until
    the row's segment is over, its text queued for the segment's thread (`stream`)."""

    cache: TokenCache
    keep: int
    cancel: threading.Event | None = None
    row: Row | None = None
    done: threading.Event = field(default_factory=threading.Event)
    outputs: queue.SimpleQueue[list[str] | None] = field(default_factory=queue.SimpleQueue)  # None: the end
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    fed: int = 0
    reused: int = -1  # set on the pass's first step

    def remaining(self) -> int:
        return len(self.cache) - self.cache.cached

    def result(self) -> tuple[torch.Tensor, int, int]:
        """Wait until it is done: (logits of the last pass's last `keep` positions, fed, reused), or its error."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.logits, self.fed, self.reused

    def stream(self) -> Iterator[str]:
        """A row's text as its passes add it, until the request ends (the segment's thread); then its failure, where
        its pass or its update failed (not where it was cancelled)."""
        while (deltas := self.outputs.get()) is not None:
            yield from filter(None, deltas)
        if self.error is not None and not isinstance(self.error, Cancelled):
            raise self.error

    def close(self) -> None:
        """Nobody reads the row's stream any more (the segment's thread): it ends after its pass in flight; wait for
        that end (the session's ids are this thread's again), and log a failure nobody is told of."""
        self.row.close()
        self.done.wait()
        if self.error is not None and not isinstance(self.error, Cancelled):
            log.error("a segment failed after its stream was closed", exc_info=self.error)


@dataclass
class SchedulerStats:
    steps: int = 0
    rows: int = 0  # row-steps: rows / steps is the mean batch
    peak_rows: int = 0


def plan_step(rows: list[tuple[int, int]]) -> list[int]:
    """How many of its pending tokens each (pending, keep) row feeds this step: all of them for a decoding row
    (a token, or a few drafts), a chunk for a prefilling one, never leaving fewer than `keep` for its last chunk.
    Prefill chunks share a small budget while any other row is in the step, so they never stall it for long, and
    the shortest prefills take it first, so a question or a tool's result does not wait behind a long prefill (a
    cache-off batch recomputing 8 sessions, an evicted history; docs/architecture.md)."""
    decoding = any(pending <= keep for pending, keep in rows)
    budget = CHUNK_BESIDE_DECODE if decoding else CHUNK_ALONE
    plan = [pending if pending <= keep else 0 for pending, keep in rows]
    for i in sorted((i for i, (pending, keep) in enumerate(rows) if pending > keep), key=lambda i: rows[i][0]):
        pending, keep = rows[i]
        n = min(pending, budget)  # (0: it waits for the next step)
        if 0 < pending - n < keep:
            n = max(0, pending - keep)
        budget -= n
        plan[i] = n
    return plan


class Scheduler:
    """Runs forward passes for many sessions' TokenCaches, batched step by step on one thread."""

    def __init__(self, model, max_rows: int = MAX_ROWS):
        model_threads()  # a bad MODEL_THREADS fails here, at load: in the thread it would end it, and passes hang
        self.model = model
        self.max_rows = max_rows
        self.ragged = ragged.supports(model)
        self.stats = SchedulerStats()
        self._waiting: list[Pass] = []
        self._active: list[Pass] = []  # taken into steps until their pass is done (a prefill may take several)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._in_turns = 0  # rows inside a turn (see turn()): their next pass is worth waiting for
        self._releasing = False
        self._exit_hook = False
        self._stepping = threading.RLock()  # held by the thread for each step: paused() waits for it

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Bracket a turn (LocalBackend.turn_scope): before its first pass and between two of its passes
        (choosing a token, checking stops, running a tool) the next step waits up to GATHER_S for it, so that rows
        decoding together stay in one pass instead of alternating, and turns that start together prefill
        together (questions sent at once reach the scheduler a few ms apart)."""
        with self._cond:
            self._in_turns += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_turns -= 1
                self._cond.notify()

    def pending(self) -> int:
        """Requests waiting for a step or in one."""
        with self._cond:
            return len(self._waiting) + len(self._active)

    def rows_in_turns(self) -> int:
        """How many rows are inside a turn now (each will ask for a pass at almost every step)."""
        return self._in_turns

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that runs the steps: None before the first pass and once released."""
        return self._thread

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No step runs inside this block (it waits for the step in flight to end): for changing the model's weights
        between two steps."""
        with self._stepping:
            yield

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy `state` (names and shapes of the model's own state dict, every one of them) into the model
        between two steps: the rows in flight go on with the new weights from their next step."""
        own = self.model.state_dict()
        missing, unknown = own.keys() - state.keys(), state.keys() - own.keys()
        misfit = [k for k in own.keys() & state.keys() if state[k].shape != own[k].shape]
        if missing or unknown or misfit:  # (checked first: load_state_dict copies what fits before it raises)
            raise ValueError(f"the weights do not fit the model: {len(missing)} missing (e.g. {sorted(missing)[:2]}), "
                             f"{len(unknown)} unknown (e.g. {sorted(unknown)[:2]}), {len(misfit)} of another shape "
                             f"(e.g. {sorted(misfit)[:2]})")
        with self.paused(), torch.no_grad():
            self.model.load_state_dict(state, strict=True)

    def forward(self, cache: TokenCache, keep: int = 1,
                cancel: threading.Event | None = None) -> tuple[torch.Tensor, int, int]:
        """TokenCache.forward through the next steps (leave `cache` alone meanwhile); Cancelled where cancelled."""
        return self.submit(cache, keep, cancel).result()

    def submit(self, cache: TokenCache, keep: int = 1, cancel: threading.Event | None = None,
               row: Row | None = None) -> Pass:
        """Like forward, without waiting. With a `row` (begun: its first pass's drafts in `cache`), the request goes
        on for as long as the row, updated from each pass's result in the scheduler's thread, gives the next pass's
        keep: its per-token work runs there right after its pass, and it joins the next step without threads waking
        in turn for the GIL (docs/concurrency.md)."""
        request = Pass(cache, keep, cancel, row)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="model-scheduler", daemon=True)
                self._thread.start()
                if not self._exit_hook:  # (a weak reference: a scheduler dropped before the exit is not kept)
                    atexit.register(_release_at_exit, weakref.ref(self))
                    self._exit_hook = True
            self._waiting.append(request)
            self._cond.notify()
        return request

    def release(self, timeout: float | None = None) -> None:
        """End the thread (and its OpenMP pool) once its work is done (waiting up to `timeout` seconds); the next
        forward starts another. For a process that then runs another model: it keeps one pool (app.threads), and
        at the process's exit (atexit, before the interpreter's teardown). The thread never ends by itself: a
        thread still there, or ending, while the process exits can abort it (a C++ `terminate` in the threads'
        teardown; docs/concurrency.md)."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._releasing = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(timeout)

    # ---- the scheduler's thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        use_model_threads()  # this thread alone runs parallel kernels (app.threads)
        while True:
            with self._cond:
                while not self._waiting and not self._active:
                    if self._releasing:
                        self._thread, self._releasing = None, False
                        return
                    self._cond.wait()
                deadline = time.monotonic() + GATHER_S
                while len(self._waiting) + len(self._active) < self._in_turns and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                room = self.max_rows - len(self._active)
                self._active += self._waiting[:room]
                del self._waiting[:room]
            try:
                with self._stepping:
                    self._step(list(self._active))
            except BaseException as error:  # the thread's boundary: every waiting row gets the error, not a hang
                for request in list(self._active):
                    self._finish(request, error=error)
                if not isinstance(error, Exception):
                    raise

    def _step(self, requests: list[Pass]) -> None:
        for request in requests:
            if request.cancel is not None and request.cancel.is_set():
                reused = request.reused if request.reused >= 0 else request.cache.cached  # (not started yet)
                self._finish(request, error=Cancelled(request.fed, reused))
                continue
            if request.reused < 0:
                try:  # checks the invariant, crops a fully cached sequence
                    request.cache.pending(self.model.config)
                except Exception as error:
                    self._finish(request, error=error)
                    continue
                request.reused = request.cache.cached
        plan = self._plan([r for r in requests if not r.done.is_set()])
        if not plan:
            return
        self.stats.steps += 1
        self.stats.rows += len(plan)
        self.stats.peak_rows = max(self.stats.peak_rows, len(plan))
        if not self.ragged:
            for request, _ in plan:
                self._solo(request)
            return
        try:
            self._ragged(plan)
        except Exception:
            for request, _ in plan:  # find the failing row: the others go on
                request.cache.rollback()
            for request, n in plan:
                try:
                    self._ragged([(request, n)])
                except Exception as error:
                    request.cache.rollback()
                    self._finish(request, error=error)

    def _plan(self, requests: list[Pass]) -> list[tuple[Pass, int]]:
        sizes = plan_step([(r.remaining(), r.keep) for r in requests])
        return [(request, n) for request, n in zip(requests, sizes) if n > 0]

    def _ragged(self, plan: list[tuple[Pass, int]]) -> None:
        rows = []
        for request, n in plan:
            kv, start, new = request.cache.pending(self.model.config)
            last = n == len(new)
            rows.append(ragged.Row(kv, new[:n], start, request.keep if last else 1, request.cache.prefix))
        logits = ragged.ragged_forward(self.model, rows)
        for (request, n), row, out in zip(plan, rows, logits):
            request.cache.advance(n)
            request.fed += n
            if request.remaining() == 0:
                self._passed(request, out)

    def _solo(self, request: Pass) -> None:
        try:
            logits, fed, _ = request.cache.forward(self.model, request.keep)
        except Exception as error:
            self._finish(request, error=error)
            return
        request.fed += fed
        self._passed(request, logits)

    def _passed(self, request: Pass, logits: torch.Tensor) -> None:
        """A request's pass is done: its row is updated from the result, and the request ends or (the row says)
        stays for its next pass in the next step."""
        row = request.row
        if row is not None:
            if row.closed:  # nobody reads it: the pass it ran is dropped
                row.drop()
                self._finish(request)
                return
            try:
                step = row.update(logits, request.fed, request.reused, self.rows_in_turns())
            except Exception as error:  # (the row's own work failed: that row alone ends, with its error)
                self._finish(request, error=error)
                return
            request.outputs.put(step.deltas)
            if step.keep is not None:
                request.keep, request.fed, request.reused = step.keep, 0, -1
                return
        self._finish(request, logits=logits)

    def _finish(self, request: Pass, logits: torch.Tensor | None = None,
                error: BaseException | None = None) -> None:
        """The one end of a request, whatever the outcome (`error`: why it failed or was cancelled): its row records
        a failure, its stream ends, and whoever waits for it is told."""
        request.logits, request.error = logits, error
        with self._cond:
            self._active.remove(request)
        if request.row is not None:
            if isinstance(error, Cancelled):
                request.row.cancelled(error.fed, error.reused)
            elif error is not None:
                request.row.failed()
            request.outputs.put(None)
        request.done.set()


EXIT_WAIT_S = 10.0  # at the process's exit, how long the scheduler's work in flight may still run


def _release_at_exit(ref: weakref.ref) -> None:
    scheduler = ref()
    if scheduler is not None:
        scheduler.release(EXIT_WAIT_S)
