"""Waiting for the end of a piece of work a test started (a chat turn, a Compare, a Batch run) by the page's own
completion marker.

The page counts each visitor's finished work per lane in an element it keeps hidden: `#turn-marker` for chat turns
and Compares, `#batch-marker` for Batch runs, each an empty `<span data-finished="N">`. The server bumps N in the
same update as the work's final status (done, error, stopped, new chat), whatever ended it. `before` reads N just
before the click; `wait_ended` polls until, in one reading of the page (one script, so the parts cannot come from
different updates), the marker reads at least N + the pieces of work started and the lane's status line holds a
final text. The count only grows, so polling cannot step over it, and no other text has to change: the same
message sent again to the same answer ends as surely as a new one."""

from __future__ import annotations

import re
from dataclasses import dataclass

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page

from tests.ui.conftest import TURN_MS

# a final status as components.status and the handlers write it, its whitespace collapsed
FINAL = re.compile(r"^(done\b.*|error: .*|stopped: .*|new chat)$")


@dataclass(frozen=True)
class Lane:
    """A lane of work: the marker that counts its finished pieces and the status line they end on."""
    marker: str
    status: str


TURN = Lane("turn-marker", "status")  # chat turns and both Compares
BATCH = Lane("batch-marker", "batch-status")  # Batch runs (in the DOM once the Batch tab has been opened)

_READ = """({marker, status}) => {
  const span = document.querySelector(`#${marker} [data-finished]`);
  const line = document.getElementById(status);
  return {
    finished: span ? Number(span.dataset.finished) : null,
    status: line ? line.textContent.replace(/\\s+/g, " ").trim() : null,
  };
}"""

# the marker's count once the page has drawn it (as text: a count of 0 would end no wait), else false
_DRAWN = """(lane) => {
  const now = (%s)(lane);
  return now.finished !== null ? String(now.finished) : false;
}""" % _READ

# the final status once the work has ended (a truthy value ends the wait), else false
_ENDED = """({lane, atLeast, final}) => {
  const now = (%s)(lane);
  const ended = now.finished !== null && now.finished >= atLeast && now.status !== null
    && new RegExp(final).test(now.status);
  return ended ? now.status : false;
}""" % _READ


@dataclass(frozen=True)
class Before:
    """The lane's count of finished work just before the click."""
    page: Page
    lane: Lane
    finished: int


def before(page: Page, lane: Lane = TURN, timeout: float = 30_000) -> Before:
    """Read the lane's marker just before starting a piece of work (a turn or a Compare: the default), once the
    page has drawn it (a page that has just loaded may not have yet)."""
    try:
        handle = page.wait_for_function(_DRAWN, arg=vars(lane), polling=100, timeout=timeout)
    except PlaywrightError:
        raise AssertionError(f"the page has no #{lane.marker} with a data-finished count after {timeout / 1000:.0f} "
                             f"s: {page.evaluate(_READ, vars(lane))}") from None
    return Before(page, lane, int(handle.json_value()))


def wait_ended(mark: Before, pieces: int = 1, timeout: float = TURN_MS) -> str:
    """Wait for the `pieces` pieces of work started after `mark` to end (see the module's text); the last final
    status, as the same reading saw it."""
    at_least = mark.finished + pieces
    try:
        handle = mark.page.wait_for_function(
            _ENDED, arg={"lane": vars(mark.lane), "atLeast": at_least, "final": FINAL.pattern}, polling=100,
            timeout=timeout)
    except PlaywrightError as error:
        now = mark.page.evaluate(_READ, vars(mark.lane))
        raise AssertionError(f"the work did not end within {timeout / 1000:.0f} s ({error.message.splitlines()[0]}): "
                             f"#{mark.lane.marker} read {mark.finished} before the click and waited for {at_least}; "
                             f"now {now}") from None
    return handle.json_value()
