"""The texts of the status line under the chat (and the Batch tab's): how a piece of work ended; and the page's
completion markers, which come in the same update as each final status."""

from __future__ import annotations

import logging

import gradio as gr

from app.backends import BackendError
from app.settings import InputError
from components.stats import counted

log = logging.getLogger(__name__)


def done_status(unanswered: int, comparing: int = 0, stopped: bool = False, ended: str | None = None,
                protocol: str | None = None) -> str:
    """A turn's or a Compare's final status on the line they share (`ended`: a turn's ending_note; `protocol`: the
    name of the protocol that answered, what `auto` resolved to); it names the visitor's work still waiting or
    running, so a plain "done" never stands while more is to come."""
    parts = [f"{counted(unanswered, 'more message')} to answer"] * bool(unanswered)
    done = "done (stopped by user)" if stopped else "done"
    return " · ".join([done, *[ended] * bool(ended), *[protocol_note(protocol)] * bool(protocol), *parts,
                       *["compare still running"] * bool(comparing)])


def protocol_note(protocol: str) -> str:
    """The status line's word on which protocol answered."""
    return f"protocol {protocol}"


def finished_marker(count: int) -> str:
    """A completion marker's HTML: an empty span whose data-finished is how many pieces of work of its lane the
    visitor has finished (components.page_state.Finished). It shows nothing; the browser tests read it."""
    return f'<span data-finished="{int(count)}"></span>'


def failure_status(error: Exception, what: str, key: str) -> str:
    """The status line for a handler that failed: a user mistake or a model server's failure as is, anything else
    logged with its traceback."""
    if isinstance(error, BackendError):
        log.warning("%s failed for session %s: %s", what, key, error)
    if isinstance(error, (InputError, BackendError)):
        gr.Warning(str(error))
        return f"error: {error}"
    log.exception("%s failed for session %s", what, key)
    gr.Warning(f"internal error: {error}")
    return f"error: internal error ({type(error).__name__}: {error})"
