"""Timing chart: each segment's prefill split into new vs reused tokens, and its time, as pandas DataFrames
for gr.BarPlot. Pure functions over engine episodes, testable without a server.

Segments are labelled `T<turn>.<n> <kind>` (turn and segment numbers from 1) in chat order, so the chart
shows turn 1's first segment and every later segment side by side: with the cache on, only the new tokens
of each segment go through the model; the rest are reused.
"""

from __future__ import annotations

import pandas as pd

from app.episode import Episode
from app.episode import count_text
from components.stats import counted

PREFILL_COLUMNS = ["segment", "part", "tokens", "ms", "turn", "kind"]
TIME_COLUMNS = ["segment", "kind", "ms", "turn"]
# Numbers typed as numbers even in an empty frame: an empty frame's columns are otherwise `object`, which Gradio
# sends as categories, and the chart, unable to stack categories, would keep the last chat's bars after New chat.
NUMBERS = {"tokens": "int64", "ms": "float64", "turn": "int64"}
PARTS = ("new", "reused")
COLOR_MAP = {"new": "#f97316", "reused": "#22c55e"}
# The charts show the last whole turns with at most this many segments in all (the last turn whole, however long):
# each chart is half the page wide, and with more bars the slanted labels run into each other.
MAX_SEGMENTS_SHOWN = 12


def segment_label(turn: int, index: int, kind: str) -> str:
    return f"T{turn}.{index} {kind}"


def _first_shown(episodes: list[Episode], most: int | None) -> int:
    """The first turn (index) of the last whole turns with at most `most` segments in all, the last one always."""
    start, count = len(episodes), 0
    while start > 0 and (most is None or start == len(episodes) or count + len(episodes[start - 1].segments) <= most):
        count += len(episodes[start - 1].segments)
        start -= 1
    return start


def _numbered(episodes: list[Episode], most: int | None):
    start = _first_shown(episodes, most)
    for turn, episode in enumerate(episodes[start:], start=start + 1):
        for index, segment in enumerate(episode.segments, start=1):
            yield turn, segment_label(turn, index, segment.kind), segment


def prefill_frame(episodes: list[Episode], most: int | None = MAX_SEGMENTS_SHOWN) -> pd.DataFrame:
    """Two rows per segment: its prefill tokens that were new (fed through the model) and reused (from cache).

    Tool segments feed nothing through the model when inserted (their tokens are prefilled by the next model
    segment), so their rows are 0 and 0; their time is the tool's run time. A model server that did not report
    a segment's counts gets no bars for it (no made-up numbers; the footer says "not reported").
    """
    rows = []
    for turn, label, segment in _numbered(episodes, most):
        for part, tokens in zip(PARTS, (segment.prefill_tokens, segment.cached_tokens)):
            if tokens is not None:
                rows.append([label, part, int(tokens), round(float(segment.ms), 1), turn, segment.kind])
    return _typed(pd.DataFrame(rows, columns=PREFILL_COLUMNS))


def time_frame(episodes: list[Episode], most: int | None = MAX_SEGMENTS_SHOWN) -> pd.DataFrame:
    """One row per segment: its wall time in ms."""
    rows = [[label, segment.kind, round(float(segment.ms), 1), turn] for turn, label, segment in _numbered(episodes, most)]
    return _typed(pd.DataFrame(rows, columns=TIME_COLUMNS))


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.astype({column: kind for column, kind in NUMBERS.items() if column in frame.columns})


def segment_order(frame: pd.DataFrame) -> list[str]:
    """The x categories in chat order (for BarPlot's `sort`)."""
    return list(dict.fromkeys(frame["segment"]))


def timing_summary(episodes: list[Episode]) -> str:
    """The last turn in one line: segments, tokens prefilled new vs reused, time."""
    if not episodes:
        return "Timing: no turns yet"
    last = episodes[-1]
    return (f"Turn {len(episodes)}: {counted(len(last.segments), 'segment')}, {count_text(last.prefill_tokens)} "
            f"tokens prefilled new, {count_text(last.reused_tokens)} reused from cache, {last.ms / 1000:.2f} s")
