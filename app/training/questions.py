"""Training questions written by seeded generators: sums (plain and hard), Jargon File look-ups and chit-chat, each
with what a right answer is. The caller keeps them apart from its held-out sets (`disjoint`)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from app.protocols.naming import name_tools
from app.tools.base import Tool
from app.tools.registry import default_tools
from app.tools.search import load_corpus


@dataclass(frozen=True)
class Question:
    """One question: its kind ("sum", "hard", "look-up", "chit-chat"), its expected answer (the value for a sum, the
    headword for a look-up, None for chit-chat) and, where generated, what a teacher writes for it: the call (tool,
    query), or a chit-chat reply."""

    text: str
    kind: str
    expected: str | None = None
    call: tuple[str, str] | None = None
    reply: str | None = None  # chit-chat: the reply a teacher writes (stage 1 learns it)


def _value(expression: str) -> str:
    return default_tools()["Calculator"].function(expression)


def _number(rng: random.Random, digits: int) -> str:
    n = rng.randint(10 ** (digits - 1), 10 ** digits - 1)
    return f"{n:,}" if n >= 1000 and rng.random() < 0.3 else str(n)


def plain_sums(rng: random.Random, n: int) -> list[Question]:
    """"What is a op b?" with random operands (1-4 digits) and + - * / (divisions come out whole)."""
    out = []
    asks = ["What is {}?", "Calculate {}.", "What's {}?", "Compute {}", "How much is {}?"]
    while len(out) < n:
        op = rng.choice("+-*/")
        a, b = _number(rng, rng.randint(1, 4)), _number(rng, rng.randint(1, 3 if op in "*/" else 4))
        if op == "/":
            b = str(rng.randint(2, 99))
            a = str(int(b) * rng.randint(2, 300))
        expression = f"{a} {op} {b}"
        out.append(Question(rng.choice(asks).format(expression), "sum", _value(expression), ("Calculator", expression)))
    return out


_WORD_PROBLEMS = [
    ("A box holds {a} pens. How many pens are in {b} boxes?", "{a} * {b}"),
    ("Sam has {a} coins and finds {b} more. How many coins does Sam have?", "{a} + {b}"),
    ("A tank holds {a} litres and {b} litres leak out. How many litres are left?", "{a} - {b}"),
    ("{a} sweets are shared equally among {b} children. How many does each child get?", "{a} / {b}"),
    ("A train travels {b} km an hour for {a} hours. How far does it go?", "{b} * {a}"),
    ("A shop sold {a} shirts on Monday and {b} on Tuesday. How many shirts did it sell?", "{a} + {b}"),
    ("I had {a} dollars and spent {b}. How much money do I have left?", "{a} - {b}"),
    ("What do you get if you multiply {a} by {b}?", "{a} * {b}"),
    ("What is {a} divided by {b}?", "{a} / {b}"),
    ("What is {b} subtracted from {a}?", "{a} - {b}"),
    ("What is the sum of {a} and {b}?", "{a} + {b}"),
    ("What is the product of {a} and {b}?", "{a} * {b}"),
]


def _word_problem(rng: random.Random, a: int, b: int) -> tuple[str, str]:
    text, expression = rng.choice(_WORD_PROBLEMS)
    if "/" in expression:
        a = a * b
    elif "-" in expression and a < b:
        a, b = b, a
    return text.format(a=a, b=b), expression.format(a=a, b=b)


def word_problems(rng: random.Random, n: int) -> list[Question]:
    """Hard sums of one family: sums in words ("A tank holds 60 litres and 7 litres leak out...")."""
    out = []
    for _ in range(n):
        text, expression = _word_problem(rng, rng.randint(2, 99), rng.randint(2, 60))
        out.append(Question(text, "hard", _value(expression), ("Calculator", expression)))
    return out


def hard_sums(rng: random.Random, n: int) -> list[Question]:
    """What plain sums leave: word problems, several operations, powers, percents, square roots, negative results."""
    out = []
    while len(out) < n:
        kind = rng.randrange(6)
        a, b, c = rng.randint(2, 99), rng.randint(2, 60), rng.randint(2, 30)
        if kind == 0:
            text, expression = _word_problem(rng, a, b)
        elif kind == 1:
            expression = rng.choice([f"{a} + {b} * {c}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}",
                                     f"{a} + {b} + {c}", f"{a} * {b} * {c}", f"({a} - {b}) * {c}"])
            text = f"What is {expression}?"
        elif kind == 2:
            base, power = rng.randint(2, 12), rng.randint(2, 5)
            text, expression = f"What is {base} to the power of {power}?", f"{base} ** {power}"
        elif kind == 3:
            percent, whole = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 60, 75, 80]), rng.randint(2, 90) * 20
            text, expression = f"What is {percent}% of {whole}?", f"{percent}% of {whole}"
        elif kind == 4:
            root = rng.randint(3, 60)
            text, expression = f"What is the square root of {root * root}?", f"sqrt({root * root})"
        else:
            small, large = rng.randint(1, 400), rng.randint(401, 2000)
            text, expression = f"What is {small} - {large}?", f"{small} - {large}"
        out.append(Question(text, "hard", _value(expression), ("Calculator", expression)))
    return out


_LOOKUP_ASKS = ["What does {} mean?", "What is {}?", "Define {}.", "Explain the term {}.", "What is the meaning of {}?",
                "Tell me what {} means."]


def lookups(rng: random.Random, n: int, avoid: Iterable[str] = ()) -> list[Question]:
    """Questions on single-word Jargon File headwords, none of the words in `avoid` (held-out questions, the
    prompt)."""
    banned = {w for text in avoid for w in re.findall(r"[a-z]+", text.lower())}
    words = sorted({title for title, _ in load_corpus() if re.fullmatch(r"[a-z]{4,14}", title)} - banned)
    return [Question(rng.choice(_LOOKUP_ASKS).format(w), "look-up", w, ("Search", w)) for w in rng.sample(words, n)]


_HELLO = "What would you like me to {actions}?"
_ME = "I am a small assistant with {abilities}."
# Chit-chat for training and the reply a teacher writes to each ({abilities} and {actions} name the session's tools,
# as the prompts' own greeting examples do: app.protocols.naming).
REPLIES = {
    "Hey!": f"Hey! {_HELLO}", "Hi there.": f"Hi! {_HELLO}", "Good afternoon!": f"Good afternoon! {_HELLO}",
    "How's it going?": f"Fine, thank you! {_HELLO}", "Thanks a lot!": "You're welcome!", "Who are you?": _ME,
    "What are you?": _ME, "Bye!": "Goodbye!", "See you later.": "See you later!", "Cheers!": "Cheers!",
    "Howdy!": f"Howdy! {_HELLO}", "Are you a robot?": "I am a small language model with {abilities}.",
    "Hello!": f"Hello! {_HELLO}", "Good night!": "Good night!",
    "What can you help me with?": "I can {actions}: I have {abilities}.", "Thanks for your help.": "You're welcome!",
    "Greetings!": f"Greetings! {_HELLO}", "Yo!": f"Hi! {_HELLO}", "How do you do?": f"How do you do? {_HELLO}",
    "Are you there?": f"Yes, I am here. {_HELLO}",
    "Hello there, how are you?": f"Hello! I am fine, thank you. {_HELLO}",
    "Many thanks!": "You're welcome!", "Hi, what's new?": f"Hi! {_ME} {_HELLO}",
    "Who built you?": "I am SmolLM2, a small language model by Hugging Face, with {abilities}.",
}
CHITCHAT = list(REPLIES)


def chitchat(rng: random.Random, n: int, tools: Mapping[str, Tool] | None = None) -> list[Question]:
    """`n` of the chit-chat questions, each with its written reply naming `tools` (the default tools)."""
    tools = default_tools() if tools is None else tools
    return [Question(t, "chit-chat", reply=name_tools(REPLIES[t], tools))
            for t in rng.sample(CHITCHAT, min(n, len(CHITCHAT)))]


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def without(questions: Iterable[Question], held_out: Iterable[str]) -> list[Question]:
    """The questions that are none of the held-out ones (whitespace and case aside): generators can repeat a
    held-out sum ("the square root of 144")."""
    banned = {_key(t) for t in held_out}
    return [q for q in questions if _key(q.text) not in banned]


def disjoint(questions: Iterable[Question], held_out: Iterable[str]) -> None:
    """Raise where a generated question is one of the held-out ones (whitespace and case aside)."""
    clash = {_key(q.text) for q in questions} & {_key(t) for t in held_out}
    if clash:
        raise ValueError(f"training questions include held-out ones: {sorted(clash)[:5]}")
