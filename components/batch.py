"""Batch tab: parse `question | expected` lines, score batch episodes, render rows and a summary, and write the
episodes as JSONL for a trainer.

Pure functions over engine episodes (no server). A batch runs twice, cache on then off; the summary shows
both totals, the speed-up and whether the two runs produced the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from app.engine import exact_match
from app.episode import Episode
from app.episode import count_text, total_or_none
from app.settings import MAX_QUESTION_CHARS, InputError
from components.compare import speedup_text
from components.chat import stop_text
from components.stats import counted

MAX_BATCH = 16
JSONL_NAME = "batch-episodes.jsonl"
COLUMNS = ["#", "question", "answer", "stops", "tool calls", "expected", "reward"]


@dataclass(frozen=True)
class Item:
    question: str
    expected: str | None = None


@dataclass(frozen=True)
class BatchRun:
    """One pass over the batch: its episodes (in row order) and its wall time."""

    episodes: list[Episode]
    seconds: float
    use_cache: bool
    stopped: bool = False  # Stop pressed during it: some rows ended early, so its time and answers are partial


def parse_batch(text: str | None, limit: int = MAX_BATCH) -> list[Item]:
    """One question per non-empty line, optionally `question | expected answer`; clear errors otherwise."""
    items = []
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip():
            continue
        question, bar, expected = line.rpartition("|") if "|" in line else (line, "", None)
        if bar and expected.strip().endswith("?"):  # "What is 6 | 3?": a question with a `|` in it, no answer
            question, bar, expected = line, "", None
        question = question.strip()
        if not question:
            raise InputError(f"line {number}: the question is empty")
        if len(question) > MAX_QUESTION_CHARS:
            raise InputError(f"line {number}: the question is too long ({len(question)} characters, "
                             f"at most {MAX_QUESTION_CHARS})")
        if bar and not expected.strip():
            raise InputError(f"line {number}: the expected answer after | is empty")
        items.append(Item(question, expected.strip() if bar else None))
    if not items:
        raise InputError("no questions: enter one per line (optionally `question | expected answer`)")
    if len(items) > limit:
        raise InputError(f"too many questions ({len(items)}, at most {limit})")
    return items


def format_items(pairs: list[tuple[str, str]]) -> str:
    """Textbox text for (question, expected) pairs, e.g. the built-in set."""
    return "\n".join(f"{q} | {a}" for q, a in pairs)


def rewards(episodes: list[Episode], items: list[Item]) -> list[float | None]:
    """exact_match of each submitted answer against its expected one; None where none is given, where Stop cut
    the row short or where the row failed (an unfinished answer is not a wrong one)."""
    return [None if item.expected is None or unfinished(episode) else exact_match(episode.answer, item.expected)
            for episode, item in zip(episodes, items)]


def unfinished(episode: Episode) -> bool:
    return episode.cut_short or episode.error is not None


def answer_text(episode: Episode) -> str:
    """The answer, and why the row failed where it did (the model or its server raised)."""
    if episode.error is None:
        return episode.answer
    return f"{episode.answer} (error: {episode.error})" if episode.answer else f"error: {episode.error}"


def accuracy(scores: list[float | None]) -> tuple[float, int] | None:
    """(total reward, questions scored), or None when no question has an expected answer."""
    scored = [s for s in scores if s is not None]
    return (sum(scored), len(scored)) if scored else None


def stops_text(episode: Episode) -> str:
    return " → ".join(stop_text(s.stop) for s in episode.model_segments) or "—"


def tool_calls_text(episode: Episode) -> str:
    calls = [f"{s.tool}: {s.query}" if s.tool else "malformed" for s in episode.segments if s.kind == "tool"]
    return "; ".join(calls) or "—"


def batch_frame(episodes: list[Episode], items: list[Item]) -> pd.DataFrame:
    """One row per query: the answer, the stop reasons of its model segments, tool calls, reward."""
    scores = rewards(episodes, items)
    rows = [[row, item.question, answer_text(episode), stops_text(episode), tool_calls_text(episode),
             item.expected if item.expected is not None else "", "" if score is None else f"{score:g}"]
            for row, (episode, item, score) in enumerate(zip(episodes, items, scores), start=1)]
    return pd.DataFrame(rows, columns=COLUMNS)


def empty_frame() -> pd.DataFrame:
    return pd.DataFrame([], columns=COLUMNS)


def identical(a: BatchRun, b: BatchRun) -> bool:
    return len(a.episodes) == len(b.episodes) and all(
        x.token_ids == y.token_ids for x, y in zip(a.episodes, b.episodes))


def batch_summary(items: list[Item], on: BatchRun, off: BatchRun | None = None) -> str:
    """Accuracy and the total time with the cache on (and off, with the speed-up and an identity check)."""
    lines = []
    score = accuracy(rewards(on.episodes, items))
    if score is None:
        lines.append("accuracy: n/a" + (_unscored(on, items) or " (no expected answers given)"))
    else:
        total, scored = score
        lines.append(f"accuracy: {total:g}/{scored} = {100 * total / scored:.0f}%{_unscored(on, items)}")
    tokens = count_text(total_or_none(e.prefill_tokens for e in on.episodes))
    lines.append(f"total time, cache on: {on.seconds:.2f} s{_partial(on)} ({len(on.episodes)} queries, {tokens} "
                 f"tokens prefilled, {count_text(total_or_none(e.reused_tokens for e in on.episodes))} reused)")
    if off is not None:
        lines.append(f"total time, cache off: {off.seconds:.2f} s{_partial(off)} "
                     f"({count_text(total_or_none(e.prefill_tokens for e in off.episodes))} tokens prefilled)")
        if on.stopped or off.stopped:  # a stopped pass did less work: a speed-up or a verdict would mislead
            lines.append("speed-up and identical answers: not compared (a pass was stopped)")
        else:
            speedup = off.seconds / on.seconds if on.seconds > 0 else float("inf")
            lines.append(f"speed-up: {speedup_text(speedup)} · identical answers: "
                         f"{'yes' if identical(on, off) else 'no'}")
    return "  \n".join(lines)


def _unscored(run: BatchRun, items: list[Item]) -> str:
    expected = [e for e, item in zip(run.episodes, items) if item.expected is not None]
    cut, failed = sum(1 for e in expected if e.cut_short), sum(1 for e in expected if e.error is not None)
    parts = [f"{counted(cut, 'answer')} cut short by Stop"] * bool(cut) + [f"{failed} failed"] * bool(failed)
    return f" ({', '.join(parts)}, not scored)" if parts else ""


def _partial(run: BatchRun) -> str:
    return " (stopped by user: partial)" if run.stopped else ""


def episode_record(episode: Episode) -> dict:
    """One episode as a trainer reads it (TRL's TextEnvironment shape): the turn's token ids (no system prompt),
    its mask and provenance (app.episode.Episode), the reward (null: none expected, cut short or failed), and the
    protocol its tokens are written in (textenv or chat)."""
    return {"question": episode.question, "answer": episode.answer, "token_ids": list(episode.token_ids),
            "mask": episode.mask, "provenance": episode.provenance, "reward": episode.reward, "guide": episode.guide,
            "protocol": episode.protocol}


def episodes_jsonl(episodes: list[Episode]) -> str:
    """One JSON object per episode, one per line (episode_record)."""
    return "".join(json.dumps(episode_record(e), ensure_ascii=False) + "\n" for e in episodes)


def write_episodes(episodes: list[Episode], directory: str | Path) -> Path:
    """The episodes as JSONL in `directory` (a folder of this request's own: never a name another visitor's
    download could share)."""
    path = Path(directory) / JSONL_NAME
    path.write_text(episodes_jsonl(episodes), encoding="utf-8")
    return path
