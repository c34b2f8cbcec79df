"""How well the engine's model does its own work on a set of questions: greedy, the guide off, all rows in one
batch; per kind, the measures the training run's eval curve plots."""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.engine.engine import Engine
from app.episode import Episode
from app.settings import Settings
from app.training.questions import Question
from app.training.rewards import right_answer, right_tool


def calls_of(episode: Episode) -> list[tuple[str, str]]:
    """The calls the model made: (tool, query) in order (a malformed call's tool: "")."""
    return [(s.tool or "", s.query or "") for s in episode.segments if s.kind == "tool"]


def right(question: Question, episode: Episode) -> bool:
    return right_answer(question.kind, question.expected, episode.answer, calls_of(episode), episode.answered)


def named_right_tool(question: Question, episode: Episode) -> bool:
    return right_tool(question.kind, calls_of(episode))


@dataclass(frozen=True)
class Score:
    """One kind's counts: questions, right tool named, right answer."""

    kind: str
    n: int
    tool: int
    right: int

    def to_json(self) -> dict:
        return {"kind": self.kind, "n": self.n, "tool": self.tool, "right": self.right}


def evaluate(engine: Engine, questions: list[Question], settings: Settings) -> tuple[list[Score], list[Episode]]:
    """Every question in a fresh session (one batch), unguided and greedy; a Score per kind, in first-seen order."""
    settings = replace(settings, guide=False, temperature=0.0)
    episodes = engine.run([q.text for q in questions], settings)
    kinds = list(dict.fromkeys(q.kind for q in questions))
    scores = []
    for kind in kinds:
        pairs = [(q, e) for q, e in zip(questions, episodes, strict=True) if q.kind == kind]
        scores.append(Score(kind, len(pairs), sum(named_right_tool(q, e) for q, e in pairs),
                            sum(right(q, e) for q, e in pairs)))
    return scores, episodes
