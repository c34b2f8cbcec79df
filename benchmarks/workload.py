"""Shared workload for the TextEnvironment benchmark (this project vs TRL 0.20.0).

Pure standard library: imported by ``benchmarks/vs_trl.py`` in the project env and by
``benchmarks/trl_side.py`` inside the separate TRL venv.

The protocol is TRL's ``TextEnvironment`` one::

    Q: What is 41 + 26?
    <request><Calculator>41 + 26<call>67<response>
    Result = 67<submit>

``few_shot_prompt()`` holds 24 such examples (about 1,150 SmolLM2 tokens), each query
is ``query_text(question)`` appended to it, so the model itself writes the tool call,
the environment inserts the tool output and ``<response>``, and the model submits.
"""

from __future__ import annotations

import random
import re

N_EXAMPLES = 24
OPS = ("+", "-", "*")


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(op)


def _operand(rng: random.Random) -> int:
    """2 or 3 digits, half and half."""
    return rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999)


def _examples() -> list[tuple[int, str, int]]:
    """24 deterministic (A, op, B) triples, ops cycling + - *.

    + and -: each operand 2 or 3 digits; *: both 2 digits (keeps the prompt near 1,150 tokens).
    """
    rng = random.Random(0)
    out = []
    for i in range(N_EXAMPLES):
        op = OPS[i % 3]
        if op == "*":
            a, b = rng.randint(10, 99), rng.randint(10, 99)
        else:
            a, b = _operand(rng), _operand(rng)
        out.append((a, op, b))
    return out


def example_text(a: int, op: str, b: int) -> str:
    expr = f"{a} {op} {b}"
    r = _apply(a, op, b)
    return (
        f"Q: What is {expr}?\n"
        f"<request><Calculator>{expr}<call>{r}<response>\n"
        f"Result = {r}<submit>\n\n"
    )


def few_shot_prompt() -> str:
    """The fixed few-shot prompt: 24 calculator examples (same string every call)."""
    return "".join(example_text(a, op, b) for a, op, b in _examples())


# 8 questions with exact answers; operands chosen to differ from the prompt's.
QUESTIONS: list[tuple[str, str]] = [
    ("What is 41 + 26?", "67"),
    ("What is 318 - 175?", "143"),
    ("What is 27 * 14?", "378"),
    ("What is 506 + 389?", "895"),
    ("What is 72 - 98?", "-26"),
    ("What is 163 * 21?", "3423"),
    ("What is 854 + 67?", "921"),
    ("What is 640 - 257?", "383"),
]


def query_text(question: str) -> str:
    """What is appended to the prompt for one episode."""
    return f"Q: {question}\n"


_SUBMIT_RE = re.compile(r"Result\s*=\s*(.*?)\s*<submit>", re.DOTALL)


def submitted_answer(text: str) -> str | None:
    """R from the last ``Result = R<submit>`` in ``text`` (spaces tolerated), else None."""
    found = _SUBMIT_RE.findall(text)
    if not found:
        return None
    return found[-1].strip()


def reward(text: str, expected: str) -> float:
    """1.0 when the submitted answer equals ``expected`` exactly, else 0.0."""
    return 1.0 if submitted_answer(text) == expected.strip() else 0.0


def _self_check() -> None:
    prompt_ops = {(a, op, b) for a, op, b in _examples()}
    prompt_nums = {n for a, _, b in prompt_ops for n in (a, b)}
    for q, ans in QUESTIONS:
        m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", q)
        assert m, q
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert str(_apply(a, op, b)) == ans, (q, ans)
        assert a not in prompt_nums and b not in prompt_nums, q


_self_check()
