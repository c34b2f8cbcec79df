"""Rewards from the environment, as GRPOTrainer's reward_funcs: each takes the batch's columns (the dataset's and
the rollout's extra fields, app.training.rollout) by keyword and returns one float per completion."""

from __future__ import annotations

from app.engine.rewards import exact_match


def exact_match_reward(completions: list, answer: list[str], expected: list[str | None] | None = None,
                       **_) -> list[float | None]:
    """1.0 where the episode's answer submits the dataset's `expected` value, else 0.0; None (no reward, as TRL reads
    it) for a row without one."""
    expected = expected or [None] * len(answer)
    return [None if want is None else exact_match(got, want) for got, want in zip(answer, expected, strict=True)]


def well_formed_call_reward(completions: list, tool_calls: list[list], tool_ok: list[list[bool]],
                            **_) -> list[float]:
    """1.0 where the episode called a tool and every call parsed and ran (no tool error), else 0.0."""
    return [float(bool(calls) and all(ok)) for calls, ok in zip(tool_calls, tool_ok, strict=True)]


def expected_tool_reward(completions: list, tool_calls: list[list], tool_ok: list[list[bool]],
                         tool: list[str | None] | None = None, **_) -> list[float | None]:
    """1.0 where the episode called the dataset's `tool` (in either protocol's spelling), only it, and every call ran,
    else 0.0; None for a row without an expected tool. It keeps the model from learning to call the calculator for
    look-ups (docs/training.md)."""
    tool = tool or [None] * len(tool_calls)
    return [None if want is None else
            float(bool(calls) and all(ok) and all(str(name).lower() == want.lower() for name, _ in calls))
            for calls, ok, want in zip(tool_calls, tool_ok, tool, strict=True)]


REWARD_FUNCS = [exact_match_reward, well_formed_call_reward, expected_tool_reward]


def right_tool(kind: str, calls: list) -> bool:
    """The question's tool named, and only it: the Calculator for a sum, Search for a look-up, none for chit-chat."""
    want = TOOL_OF.get(kind)
    return [str(name).lower() for name, _ in calls] == ([want.lower()] if want else [])


def right_answer(kind: str, expected: str | None, answer: str, calls: list, answered: bool) -> bool:
    """A sum submits its value; a look-up searches its headword, once, and answers with more than the word; chit-chat
    answers without a call; each ends its answer itself."""
    if not answered:
        return False
    if kind in ("sum", "hard"):
        return exact_match(answer, expected or "") == 1.0
    if kind == "look-up":
        query = str(calls[0][1]).strip().lower() if len(calls) == 1 else ""
        return right_tool(kind, calls) and query == (expected or "").lower() and len(answer) > len(query) + 8
    return not calls


TOOL_OF = {"sum": "Calculator", "hard": "Calculator", "look-up": "Search"}  # (chit-chat: no tool)


def right_answer_reward(completions: list, kind: list[str], expected: list[str | None], answer: list[str],
                        tool_calls: list[list], answered: list[bool], **_) -> list[float]:
    """1.0 where the episode answered its question right (`right_answer`), else 0.0."""
    return [float(right_answer(*row)) for row in zip(kind, expected, answer, tool_calls, answered, strict=True)]


def right_tool_reward(completions: list, kind: list[str], tool_calls: list[list], tool_ok: list[list[bool]],
                      **_) -> list[float]:
    """1.0 where the episode named the question's tool (none for chit-chat) and every call ran, else 0.0."""
    return [float(right_tool(k, calls) and all(ok)) for k, calls, ok in zip(kind, tool_calls, tool_ok, strict=True)]


TASK_REWARD_FUNCS = [right_answer_reward, right_tool_reward]  # scripts/train.py's stage 2
