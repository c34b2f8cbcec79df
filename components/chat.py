"""Chat rendering: engine episodes and segments -> Chatbot messages (role/content/metadata dicts).

Pure functions, testable without a server. Every segment is its own message: model text with a footer that
names its stop reason and token counts, and each tool call as a collapsible part titled with the tool and
query, holding the result. Model and tool text is escaped, so `<call>` shows as text instead of vanishing
as an unknown HTML tag, and `*`, `_`, `#` stay literal instead of turning into markdown.
"""

from __future__ import annotations

import html
import re

from app.episode import Episode, Segment, Stop, StopReason

_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+\-.!|~$])")


def escape_text(text: str) -> str:
    """Text shown literally in a markdown+HTML message: markdown punctuation backslash-escaped, <>& as entities."""
    return html.escape(_MARKDOWN_SPECIALS.sub(r"\\\1", text), quote=False)


def code(text: str) -> str:
    """Inline code span that survives any backticks in text."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def stop_text(stop: Stop | None) -> str:
    """A stop reason in words: `string match <call>`, `EOS`, `max_length (max_new_tokens)`, `stopped by user`."""
    return "running" if stop is None else stop.label


def stop_markdown(stop: Stop | None) -> str:
    """The stop reason for a message footer; stop strings in code formatting so they render visibly."""
    if stop is not None and stop.reason is StopReason.STRING_MATCH and stop.string:
        return f"string match {code(stop.shown_string)}"
    return escape_text(stop_text(stop))


def prefill_text(segment: Segment) -> str:
    if segment.prefill_tokens is None or segment.cached_tokens is None:
        return "prefill and cache reuse not reported by the model server"
    return f"prefill {segment.prefill_tokens} new tokens · {segment.cached_tokens} reused from cache"


def segment_footer(segment: Segment) -> str:
    """A model segment's status line: why it stopped, its prefill, its tokens and time, and what the guide chose
    of it ("guided: 9 forced, 2 steered"; nothing where the guide changed nothing or was off)."""
    guided = f" · {escape_text(segment.guided_label)}" if segment.guided_label else ""
    return (f"stop: {stop_markdown(segment.stop)} · {prefill_text(segment)} · {segment.generated_tokens} generated "
            f"· {segment.ms:.0f} ms{guided}")


def _body(text: str) -> str:
    text = text.strip("\n")
    return escape_text(text) if text.strip() else "*(no text)*"


def model_message(segment: Segment) -> dict:
    return {"role": "assistant", "content": f"{_body(segment.text)}\n\n*{segment_footer(segment)}*"}


WAITING = "*waiting for the model…*"  # a sent message whose turn has not written its first token yet


def pending_model_message(text: str) -> dict:
    """The model segment being generated, before its stop reason is known (before its first token: waiting)."""
    body = escape_text(text.strip("\n")) if text.strip() else ""
    return {"role": "assistant", "content": f"{body}\n\n*generating…*" if body else WAITING}


def waiting_messages(question: str) -> list[dict]:
    """A sent message whose turn has not started (the visitor's previous turn, or other visitors', run)."""
    return [user_message(question), {"role": "assistant", "content": WAITING}]


def tool_title(segment: Segment) -> str:
    if segment.tool is None:
        return "Tool call (malformed)"
    return f"Tool {segment.tool}: {segment.query or ''}"


def tool_message(segment: Segment) -> dict:
    """A collapsible part: title = tool and query, body = the result the model reads (with `<response>`)."""
    return {
        "role": "assistant",
        "content": escape_text(segment.text.strip("\n")) or "*(empty result)*",
        "metadata": {
            "title": escape_text(tool_title(segment)),
            "log": ("ok" if segment.ok else "error") + (f" · cut: {segment.stop.label}" if segment.stop else ""),
            # (to the microsecond: rounded to the millisecond, a tool that takes under 0.5 ms would read "0s"
            # beside the others' "1.0ms")
            "duration": round(segment.ms / 1000, 6),
        },
    }


def segment_message(segment: Segment) -> dict:
    return model_message(segment) if segment.kind == "model" else tool_message(segment)


def user_message(question: str) -> dict:
    return {"role": "user", "content": escape_text(question)}


def note_message(note: str) -> dict:
    return {"role": "assistant", "content": escape_text(note), "metadata": {"title": "Note"}}


def episode_messages(episode: Episode, partial: str | None = None) -> list[dict]:
    """One question and its segments; `partial` is the text of a model segment still being generated."""
    messages = [user_message(episode.question)]
    messages.extend(segment_message(s) for s in episode.segments)
    if episode.unrun_call:
        messages.append(note_message(episode.UNRUN_NOTE))
    if partial is not None:
        messages.append(pending_model_message(partial))
    return messages


def chat_messages(episodes: list[Episode], notes: list[str] = (), partial: str | None = None,
                  waiting: list[str] = ()) -> list[dict]:
    """The whole conversation; `partial` belongs to the last episode; `waiting`: sent messages not started yet."""
    messages = [note_message(n) for n in notes]
    for i, episode in enumerate(episodes):
        messages.extend(episode_messages(episode, partial if i == len(episodes) - 1 else None))
    for question in waiting:
        messages.extend(waiting_messages(question))
    return messages


def ending_note(episode: Episode | None) -> str | None:
    """Why a turn ended where the model did not end its answer itself (Episode.answered), so that a reply that
    looped to the repetition stop with no answer is not shown as plain "done"."""
    if episode is None:
        return None
    if episode.unrun_call:
        return "ended by max_turns: the last tool call was not run"
    stop = episode.stop
    if stop is None or episode.answered or stop.reason is StopReason.CANCELLED:
        return None
    return f"ended by {stop.label}"
