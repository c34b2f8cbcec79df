"""Waiting for the end of a piece of work a test started (a chat turn, a Compare, a Batch run), from what the page
shows, without missing a short one.

Waiting for the status line to *leave* its previous text missed a turn that went "done" -> "running" -> "done"
between two polls (it then timed out after TURN_MS). Here the page is read before the click (`before`), and the work
has ended when, in one reading of the page (one script, so the parts cannot come from different updates):
  - the status line holds a final text (FINAL: "done…" or "error: …"),
  - the chat shows no turn in progress ("waiting for the model…", "generating…"; where the chat is watched), and
  - something only the end of this work changes differs from the reading before the click: the status text, the
    chat's user messages (a turn's message stays "waiting for the model…" in the chat until the turn's final
    update), or an output the app writes in the same update as the final status (`watched`: the timing summary
    of a turn, the Compare table, the Batch summary).
Every condition is a state that stays once reached, so polling cannot step over it. The page has no per-turn
completion marker (a turn counter or the episode's id) yet; where none of those differ (the same message, sent
again right after the prompt changed, to the same final status and timing line) the wait fails loudly after
TURN_MS: it never passes before the work has ended."""

from __future__ import annotations

import re
from dataclasses import dataclass

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page

from tests.ui.conftest import TURN_MS

# (the element's text has surrounding whitespace; "done · ended by …" where the model did not end its answer)
FINAL = re.compile(r"^\s*(done( · [^\n]*)?\s*|error: [\s\S]*)$")
BUSY = ("waiting for the model…", "generating…")  # components/chat.py: WAITING, pending_model_message

_READ = """({statusId, watched, chat, busy}) => {
  const text = el => el ? el.textContent.replace(/\\s+/g, " ").trim() : null;
  const box = chat ? document.querySelector("#chat") : null;
  return {
    status: text(document.getElementById(statusId)),
    users: box ? [...box.querySelectorAll(".message.user")].map(text) : [],
    busy: box ? busy.some(marker => box.textContent.includes(marker)) : false,
    watched: watched.map(id => text(document.getElementById(id))),
  };
}"""

_ENDED = """({read, before, final}) => {
  const now = (%s)(read);
  if (now.busy || now.status === null || !new RegExp(final).test(now.status)) return false;
  const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  return now.status !== before.status || !same(now.users, before.users) || !same(now.watched, before.watched);
}""" % _READ


@dataclass
class Before:
    """The page as it was before the click: what the end of the work has to differ from."""
    page: Page
    read: dict
    state: dict


def before(page: Page, status_id: str = "status", watched: tuple[str, ...] = ("timing-summary",),
           chat: bool = True) -> Before:
    """Read the page just before starting a piece of work (a turn: the defaults)."""
    read = {"statusId": status_id, "watched": list(watched), "chat": chat, "busy": list(BUSY)}
    return Before(page, read, page.evaluate(_READ, read))


def wait_ended(mark: Before, timeout: float = TURN_MS) -> str:
    """Wait for the work started after `mark` to end (see the module's text); its final status, stripped."""
    try:
        mark.page.wait_for_function(_ENDED, arg={"read": mark.read, "before": mark.state, "final": FINAL.pattern},
                                    polling=100, timeout=timeout)
    except PlaywrightError as error:
        now = mark.page.evaluate(_READ, mark.read)
        raise AssertionError(f"the work did not end within {timeout / 1000:.0f} s ({error.message.splitlines()[0]}): "
                             f"before the click {mark.state}, now {now}") from None
    return mark.page.locator(f"#{mark.read['statusId']}").inner_text().strip()
