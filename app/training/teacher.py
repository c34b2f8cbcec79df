"""Stage 1's teacher: the engine's own guide, told the call each generated question needs, and a written reply for
chit-chat. The guide alone claims only the calls it can read off a question ("What is 41 * 23?"); a word problem, a
power or a square root it leaves to the model, which gets most of them wrong, so a graded set of its episodes would
hardly teach them. The base model's own greetings mostly say "You're welcome!" (the prompt's last chit-chat example),
to "Who are you?" too, so chit-chat is taught from written replies (app.training.questions.REPLIES)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from app.episode import Episode, Provenance
from app.protocols.base import encode
from app.tools.base import Tool
from app.training.questions import Question
from app.training.sft import IGNORE, Example


def teacher_tools(tools: Mapping[str, Tool], questions: Iterable[Question]) -> dict[str, Tool]:
    """`tools`, each claiming exactly the generated questions whose call it is, with the query the generator wrote
    (and nothing else: a question without a call is left to the model)."""
    queries: dict[str, dict[str, str]] = {name: {} for name in tools}
    for question in questions:
        if question.call is not None:
            tool, query = question.call
            if tool not in queries:
                raise ValueError(f"a question calls {tool!r}, which is not among the tools {sorted(tools)}")
            queries[tool][question.text.strip()] = query
    return {name: replace(tool, claims=queries[name].get) for name, tool in tools.items()}


def replied(episode: Episode, reply: str, tokenizer) -> Example | None:
    """The teacher's episode of a chit-chat question as an example whose answer is `reply`: the question's tokens,
    the answer's start where the guide forced it (textenv's "Result =") and the episode's own ending (EOS, textenv's
    `<submit>`) kept, the model's words replaced. None where the episode called a tool or did not end its answer."""
    if not episode.answered or not episode.answer or any(s.kind == "tool" for s in episode.segments):
        return None
    start = episode.query_end - episode.query_start  # (token_ids begin with the question)
    region, authors = episode.token_ids[start:], episode.provenance[start:]
    end = next(n for n in range(len(region) + 1) if episode.answer in tokenizer.decode(region[:n]))
    forced = max((n + 1 for n in range(end) if authors[n] == Provenance.FORCED.value), default=0)
    head = tokenizer.decode(region[:forced])
    written = encode(tokenizer, f"{head} {reply}" if head and not head.endswith(" ") else head + reply)
    ids = episode.token_ids[:start] + written + region[end:]
    return Example(ids, [IGNORE] * start + ids[start:])
