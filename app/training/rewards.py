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
