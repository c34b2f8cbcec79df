"""Rewards for batch episodes (as in TRL's TextEnvironment.run(queries) with a reward_fn), and a built-in
question set with known answers."""

from __future__ import annotations

import json
import re

from app.paths import ASSETS

_RESULT = re.compile(r"Result\s*=")


def submitted(answer: str) -> str:
    """The value a model submitted: what follows the last `Result =` (else the whole answer), trimmed."""
    return _RESULT.split(answer)[-1].strip().rstrip(".").strip()


def exact_match(answer: str, expected: str) -> float:
    """1.0 when the submitted value equals the expected one (ignoring thousands separators), else 0.0."""
    def norm(text: str) -> str:
        return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.strip())

    return 1.0 if norm(submitted(answer)) == norm(expected) else 0.0


def builtin_questions() -> list[tuple[str, str]]:
    """Arithmetic questions with exact answers (assets/batch_questions.json)."""
    rows = json.loads((ASSETS / "batch_questions.json").read_text(encoding="utf-8"))
    return [(row["question"], row["answer"]) for row in rows]
