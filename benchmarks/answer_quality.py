"""Answer quality on the default prompt: look-ups, arithmetic and chit-chat, with the page's settings.

    python3 benchmarks/answer_quality.py               # the table (about 3-5 min on 2 cores)
    python3 benchmarks/answer_quality.py --episodes    # ... and every episode as the model wrote it
    python3 benchmarks/answer_quality.py --set dev     # the tuning set instead of the reported one
    python3 benchmarks/answer_quality.py --set wide    # 40 more tuning look-ups (ending and tool only), 88 sums
    python3 benchmarks/answer_quality.py --weights float32 int8   # both formats, and every answer that differs
    python3 benchmarks/answer_quality.py --backend local server --guide on off   # guided answers on and off, in
                                                   # process and through llama.cpp's server (one column each)
    python3 benchmarks/answer_quality.py --protocol textenv chat --guide on off   # both protocols (app/protocols/)
    python3 benchmarks/answer_quality.py --protocol textenv chat --guide on off --floors   # CI
                                                   # (tests/test_answer_quality.py): exit 1 under FLOORS

Each question runs greedy in a fresh session (the page's first turn); then the built-in Batch questions
(assets/batch_questions.json) run as one batch. The reported ("test") look-ups are
Jargon File headwords that appear nowhere in the system prompt; their key phrases were written from each
entry's opening sense before any run. The "dev" set (the look-up words of the issue that reported the problem,
and arithmetic and chit-chat questions of its own, written before any run) is the one changes are tried on, so
that no reported question, look-up, arithmetic or greeting, is tuned on.

`--backend server` starts llama.cpp's own server on the bundled GGUF (Q4_1) the way the tests do
(tests/support/llama_server.py; built by scripts/build_llama_server.sh) and asks it through the app's server
backend, with the same prompt, settings and guide (the guide's grammar goes with each request).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.decoding.stops import StopReason  # noqa: E402
from app.engine.rewards import builtin_questions, exact_match, submitted  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.episode import Episode
from app.backends.local import LocalBackend  # noqa: E402
from app.model.loading import WEIGHT_FORMATS, load_model, load_tokenizer, weight_format  # noqa: E402
from app.protocols.textenv.markers import SUBMIT  # noqa: E402
from app.settings import Settings

from components.inputs import DEFAULTS as PAGE  # noqa: E402  (the page's settings; no Gradio import)

# (question, key phrases: an answer holding any of them, case-insensitively, says what the entry says)
LOOKUPS = {
    "test": [
        ("Define heisenbug.", ["disappears", "alters its behavior"]),
        ("What is a tarball?", ["archive"]),
        ("What does vaporware mean?", ["announced", "release"]),
        ("What is spaghetti code?", ["tangled", "complex"]),
        ("What does lurker mean?", ["silent majority", "read", "posts"]),
        ("What is a guru?", ["expert"]),
        ("What does deadlock mean?", ["waiting", "unable to proceed"]),
        ("What is bloatware?", ["minimal functionality", "disproportionate", "diskspace", "memory"]),
        ("Explain the term sneakernet.", ["carrying", "media", "physically"]),
        ("What is a bug?", ["unwanted", "unintended", "malfunction"]),
        ("What does tweak mean?", ["change slightly", "slightly"]),
        ("What is a newbie?", ["neophyte"]),
        ("What is a sysop?", ["operator", "bulletin"]),
        ("What does nuke mean?", ["delete"]),
        ("What is a crock?", ["awkward", "ought to be made cleaner"]),
        ("What does glitch mean?", ["interruption"]),
        ("What is a geek?", ["concentration rather than conformity", "skill"]),
        ("What is the meaning of bikeshedding?", ["minor", "marginal", "disputes"]),
        ("What is a core dump?", ["contents of core", "aborted"]),
        ("What does phreaking mean?", ["phone"]),
        ("What is a patch?", ["temporary addition", "quick-and-dirty", "remedy"]),
        ("What does elegant mean?", ["simplicity", "grace"]),
        ("What is a bignum?", ["multiple-precision", "large integers", "very large"]),
        ("What does lossage mean?", ["bug or malfunction", "result of a bug"]),
        ("What is a cookie in hacker slang?", ["handle", "transaction id", "token of agreement"]),
    ],
    "dev": [
        ("What does kludge mean?", ["rube goldberg", "crock that works", "kluge"]),
        ("What is cruft?", ["unpleasant substance", "shoddy"]),
        ("What is a hacker?", ["enjoys exploring", "programmable systems"]),
        ("What does daemon mean?", ["not invoked explicitly", "dormant"]),
        ("What does frob mean?", ["protruding arm", "small thing"]),
        ("What is a hack?", ["quick job"]),
        ("What does bogus mean?", ["non-functional", "useless", "false"]),
        ("What is a magic cookie?", ["passed between routines", "capability ticket", "opaque identifier"]),
        ("What does hairy mean?", ["complicated"]),
        ("What does munge mean?", ["imperfectly transform"]),
        ("What is yak shaving?", ["pointless activity", "necessary"]),
        ("What does foo mean?", ["disgust", "sample name"]),
    ],
}

# Forty more tuning look-ups, no key phrases (only the ending and the tool are scored): single-word headwords
# drawn at random (seed 7) from those whose search result is their own entry, none in the prompt or the sets
# above, asked in five phrasings. A dozen dev words proved too few to choose between prompts.
_WIDE = ["hexit", "mainsleaze", "support", "meatspace", "flamer", "flame", "vannevar", "clocks", "snippage", "bazaar",
         "scruffies", "punt", "mode", "hardwired", "shim", "interrupt", "flypage", "break", "chawmp", "spike", "chain",
         "gumby", "toaster", "burble", "background", "teergrube", "verbiage", "spoof", "gorets", "lase", "bixie",
         "newline", "dahmum", "semi", "flush", "nugry", "barn", "epoch", "hakspek", "frag"]
_PHRASINGS = ["What does {} mean?", "What is {}?", "Define {}.", "Explain the term {}.", "What is the meaning of {}?"]
LOOKUPS["wide"] = [(_PHRASINGS[i % len(_PHRASINGS)].format(w), []) for i, w in enumerate(_WIDE)]

ARITHMETIC = {"test": [
    ("What is 57 * 38?", "2166"), ("What is 1,024 + 2,048?", "3072"), ("What is 900 / 36?", "25"),
    ("How much is 25% of 640?", "160"), ("What is 3 to the power of 7?", "2187"),
    ("What is the square root of 729?", "27"), ("What is 7,342 - 2,918?", "4424"), ("What is 12 * 12 * 12?", "1728"),
    ("What is (15 + 27) * 3?", "126"), ("What is 123 + 456 + 789?", "1368"), ("What is 1000 - 1?", "999"),
    ("What is 81 / 9?", "9"), ("What is 65 * 43?", "2795"), ("What is 5000 / 125?", "40"),
    ("What is 2 to the power of 16?", "65536"), ("What is 999 * 3?", "2997"), ("What is 45% of 200?", "90"),
    ("What is 17 + 38?", "55"), ("What is 4,096 / 64?", "64"), ("What is 73 - 29?", "44"),
    ("What is the square root of 2025?", "45"), ("What is 14 * 15?", "210"), ("What is 360 / 8?", "45"),
    ("What is 2.5 * 4?", "10"),
], "dev": [
    ("What is 48 * 27?", "1296"), ("What is 2,500 + 7,500?", "10000"), ("What is 144 / 12?", "12"),
    ("How much is 20% of 350?", "70"), ("What is 5 to the power of 4?", "625"),
    ("What is the square root of 169?", "13"), ("What is 8,000 - 3,250?", "4750"), ("What is (9 + 6) * 4?", "60"),
    ("What is 250 + 375 + 125?", "750"), ("What is 63 / 7?", "9"), ("What is 36 * 25?", "900"),
    ("What is 30% of 90?", "27"), ("What is 88 - 19?", "69"), ("What is 1.5 * 6?", "9"), ("What is 11 * 11?", "121"),
    ("What is 7,200 / 80?", "90"),
]}
# 88 more tuning sums, none a test or dev sum: 48 written by a seeded generator before any run, and 40 more
ARITHMETIC["wide"] = [
    ("What is 9 to the power of 2?", "81"), ("What is 12 * 211?", "2532"),
    ("What is the square root of 676?", "26"), ("What is 8,652 + 9,181?", "17833"),
    ("What is 7 to the power of 2?", "49"), ("What is 82 * 79?", "6478"), ("What is 30% of 240?", "72"),
    ("What is 8 to the power of 2?", "64"), ("What is 18744 / 66?", "284"), ("What is 36 * 805?", "28980"),
    ("What is 8227 - 370?", "7857"), ("What is 1331 - 142?", "1189"), ("What is 75 * 605?", "45375"),
    ("What is 6391 - 1659?", "4732"), ("What is 2221 - 126?", "2095"), ("What is 869 + 7,370?", "8239"),
    ("What is 12180 / 84?", "145"), ("What is the square root of 2401?", "49"), ("What is 8389 - 2,704?", "5685"),
    ("What is the square root of 361?", "19"), ("What is 9,685 + 1611?", "11296"),
    ("What is 11 to the power of 3?", "1331"), ("What is 2 to the power of 5?", "32"),
    ("What is 96 * 862?", "82752"), ("What is 60% of 760?", "456"), ("What is 20% of 40?", "8"),
    ("What is 31 * 911?", "28241"), ("What is 6802 - 2,221?", "4581"), ("What is 33 * 173?", "5709"),
    ("What is the square root of 1764?", "42"), ("What is 6829 + 1,842?", "8671"), ("What is 60 * 824?", "49440"),
    ("What is 11 to the power of 2?", "121"), ("What is 12 to the power of 2?", "144"),
    ("What is 40% of 500?", "200"), ("What is 7 to the power of 5?", "16807"), ("What is 55 * 453?", "24915"),
    ("What is 8 to the power of 4?", "4096"), ("What is 8121 + 5346?", "13467"),
    ("What is the square root of 25?", "5"), ("What is 10 * 153?", "1530"), ("What is 6 to the power of 3?", "216"),
    ("What is 12 to the power of 3?", "1728"), ("What is 1056 / 88?", "12"), ("What is 8,196 - 4592?", "3604"),
    ("What is 6757 + 5,609?", "12366"), ("What is 8294 / 26?", "319"), ("What is 10% of 60?", "6"),
    # results equal to an operand or to an example's result in the prompt (100 is the last one's): the model has
    # copied those instead of the tool's output (19/24 correct at 6a687de, int8; the other 48: 48/48)
    ("What is 625 / 25?", "25"), ("What is 10,000 / 100?", "100"), ("What is 49 / 7?", "7"),
    ("What is 256 / 16?", "16"), ("What is 400 / 4?", "100"), ("What is 50 + 50?", "100"),
    ("What is 25 * 4?", "100"), ("What is 1000 / 10?", "100"), ("What is 7 * 13?", "91"),
    ("What is 100 - 62?", "38"), ("What is 32 * 32?", "1024"), ("What is 5,000 + 30?", "5030"),
    ("What is 2,500 / 50?", "50"), ("What is 900 / 30?", "30"), ("What is 64 / 8?", "8"), ("What is 36 / 6?", "6"),
    ("What is 300 / 3?", "100"), ("What is 8,100 / 90?", "90"), ("What is 1,600 / 40?", "40"),
    ("What is 200 / 2?", "100"), ("What is 5 * 20?", "100"), ("What is 20 * 5?", "100"),
    ("What is 121 / 11?", "11"), ("What is 3,600 / 60?", "60"),
    # small sums with a negative result or zero: the model sent most of them to Search, and answered from the
    # operands (3 - 7: "Result = 3 - 7: 3"; 10 - 25: "Result = 10"; 100 - 250 went to the Calculator and still
    # read "Result = (-150)")
    ("What is 3 - 7?", "-4"), ("What is 10 - 25?", "-15"), ("What is 8 - 9?", "-1"), ("What is 2 - 5?", "-3"),
    ("What is 1 - 1?", "0"), ("What is 100 - 250?", "-150"), ("What is 12 - 30?", "-18"), ("What is 5 - 8?", "-3"),
    ("What's 6 - 9?", "-3"), ("Compute 3 - 10", "-7"), ("What is 0 - 5?", "-5"), ("What is 4 - 7?", "-3"),
    ("How much is 2 - 9?", "-7"), ("What is 1 - 2?", "-1"), ("What is 4 - 6?", "-2"), ("What is 7 - 3?", "4"),
]

CHITCHAT = {"test": ["Hello, who are you?", "Hello! What can you do?", "Hi!", "Good morning!", "Thanks, that helps.",
                     "How are you today?", "What is your name?", "Tell me about yourself."],
            "dev": ["Hey there!", "Thank you!", "Good evening!", "Who made you?", "Nice to meet you.", "What's up?",
                    "Can you help me?", "Goodbye!"]}
CHITCHAT["wide"] = []


@dataclass
class Tally:
    rows: list[dict] = field(default_factory=list)

    def hits(self, key: str) -> int:
        return sum(1 for row in self.rows if row[key])

    def rate(self, key: str) -> str:
        hits = self.hits(key)
        if not self.rows:
            return "-"
        return f"{hits}/{len(self.rows)} ({100 * hits / len(self.rows):.0f} %)"


def tool_calls(episode: Episode) -> list[str]:
    return [s.tool or "(malformed)" for s in episode.segments if s.kind == "tool"]


def ended_by(episode: Episode, *strings: str) -> bool:
    stop = episode.stop
    return stop is not None and stop.reason is StopReason.STRING_MATCH and stop.string in strings


def over_limits(episode: Episode, settings: Settings) -> bool:
    """The answer ran into max_turns or max_length instead of ending."""
    length = any(s.stop and s.stop.reason is StopReason.MAX_LENGTH for s in episode.model_segments)
    return length or len(tool_calls(episode)) >= settings.max_turns


def answered(episode: Episode) -> bool:
    """The answer ended as its protocol ends one: `<submit>` (textenv), EOS (chat: the end of its message)."""
    if episode.protocol == "chat":
        return episode.stop is not None and episode.stop.reason is StopReason.EOS
    return ended_by(episode, SUBMIT)


def lookup_row(episode: Episode, keys: list[str], settings: Settings) -> dict:
    calls = tool_calls(episode)
    return {"clean": answered(episode) and calls == ["Search"],
            "key": any(k.lower() in episode.answer.lower() for k in keys),
            "limits": over_limits(episode, settings)}


def arithmetic_row(episode: Episode, expected: str, settings: Settings) -> dict:
    return {"calc": "Calculator" in tool_calls(episode), "correct": exact_match(episode.answer, expected) == 1.0,
            "limits": over_limits(episode, settings)}


def chitchat_row(episode: Episode, settings: Settings) -> dict:
    ended = ended_by(episode, SUBMIT) or (episode.stop is not None and episode.stop.reason is StopReason.EOS)
    return {"no_tool": not tool_calls(episode), "ended": ended, "limits": over_limits(episode, settings),
            "echo": echoes(episode)}


def echoes(episode: Episode) -> bool:
    """The answer is the question again ("Thank you!" → "Result = Thank you!"), word for word."""
    def words(text: str) -> list[str]:
        return re.findall(r"\w+", text.lower())

    return words(submitted(episode.answer)) == words(episode.question)


def transcript(episode: Episode) -> str:
    parts = [f"Q: {episode.question}"]
    for s in episode.segments:
        label = s.stop.label if s.stop else f"tool {s.tool}"
        parts.append(f"  [{s.kind}, {label}] {s.text!r}")
    return "\n".join(parts)


def run_set(engine: Engine, which: str, settings: Settings, episodes: bool) -> dict:
    """Every question of a set, each in a fresh session, and the built-in Batch questions as one batch."""
    tallies = {"look-up": Tally(), "arithmetic": Tally(), "chit-chat": Tally()}
    answers, seconds, began = {}, [], time.perf_counter()
    work = ([("look-up", q, lambda e, k=k: lookup_row(e, k, settings)) for q, k in LOOKUPS[which]]
            + [("arithmetic", q, lambda e, x=x: arithmetic_row(e, x, settings)) for q, x in ARITHMETIC[which]]
            + [("chit-chat", q, lambda e: chitchat_row(e, settings)) for q in CHITCHAT[which]])
    for kind, question, score in work:
        episode = engine.ask(engine.new_session(), question, settings)
        row = score(episode)
        tallies[kind].rows.append(row)
        answers[question] = episode.answer
        seconds.append(episode.ms / 1000)
        if episodes:
            print(f"\n{kind} {row}\n{transcript(episode)}")
    builtin = builtin_questions()
    batch = engine.run([q for q, _ in builtin], settings,
                       reward_fn=lambda row, episode: exact_match(episode.answer, builtin[row][1]))
    answers.update((q, episode.answer) for (q, _), episode in zip(builtin, batch))
    print(f"{len(work)} questions in {time.perf_counter() - began:.0f} s (median {statistics.median(seconds):.1f} s, "
          f"max {max(seconds):.1f} s an episode)")
    return dict(tallies=tallies, answers=answers, batch=f"{sum(e.reward for e in batch):.0f}/{len(batch)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", choices=sorted(LOOKUPS), default="test", help="which look-up questions")
    parser.add_argument("--episodes", action="store_true", help="print every episode")
    parser.add_argument("--prompt", type=Path, help="a prompt template file instead of the default")
    parser.add_argument("--weights", nargs="+", choices=WEIGHT_FORMATS, default=[weight_format()],
                        help="formats to run in process, one after another (the first column is compared with the "
                             "others)")
    parser.add_argument("--backend", nargs="+", choices=("local", "server"), default=["local"],
                        help="in process (local) and/or through llama.cpp's server on the bundled GGUF (server)")
    parser.add_argument("--guide", nargs="+", choices=("on", "off"), default=None,
                        help="guided answers on and/or off (default: on; the page defaults to off)")
    parser.add_argument("--protocol", nargs="+", choices=("textenv", "chat"), default=None,
                        help="how model and tools talk (app/protocols/; default: textenv; the page's auto is chat "
                             "with the shipped adapter)")
    parser.add_argument("--floors", action="store_true",
                        help="exit 1 where a test-set count is under its floor (FLOORS; CI runs this)")
    args = parser.parse_args()
    if args.floors and args.set != "test":
        parser.error("--floors are the test set's")
    prompt = args.prompt.read_text(encoding="utf-8") if args.prompt else None
    guides = args.guide or ["on"]
    protocols = args.protocol or ["textenv"]

    def label(name: str, guide: str, protocol: str) -> str:  # (the default run's column keeps its old name)
        name = name if args.protocol is None else f"{protocol}, {name}"
        return name if args.guide is None else f"{name}, guide {guide}"

    runs = {}
    for where in args.backend:
        if where == "local":
            for weights in args.weights:
                loaded = LocalBackend(load_model(weights=weights))
                for protocol in protocols:
                    engine = Engine(loaded, prompt=prompt, protocol=protocol)
                    for guide in guides:
                        runs[label(weights, guide, protocol)] = measure(engine, guide, args)
                loaded.scheduler.release()  # one model thread (one OpenMP pool) at a time: app.threads
        else:
            from tests.support.llama_server import LlamaServer
            from app.backends.server import ServerBackend
            from app.backends.server_client import ModelServer

            with LlamaServer() as llama:  # as the tests start it: 4 slots of 4,096 tokens, 2 threads, loopback
                server = ServerBackend.connect(ModelServer(llama.url, timeout_s=120), tokenizer=load_tokenizer())
                for protocol in protocols:
                    engine = Engine(server, prompt=prompt, protocol=protocol)
                    for guide in guides:
                        runs[label("llama-server", guide, protocol)] = measure(engine, guide, args)
    print_table(args.set, runs)
    if args.floors and (under := under_floors(runs)):
        print("\nunder the floors (benchmarks/answer_quality.py FLOORS):\n" + "\n".join(under))
        return 1
    first, *others = runs
    for other in others:
        changed = [(q, a, runs[other]["answers"][q]) for q, a in runs[first]["answers"].items()
                   if runs[other]["answers"][q] != a]
        print(f"\nanswers that differ, {first} → {other}: {len(changed)} of {len(runs[first]['answers'])}")
        for question, before, after in changed:
            print(f"- {question}\n    {before!r}\n    {after!r}")
    return 0


# The test set's floors, a little below the counts of 2026-12-07 (int8, Intel Xeon Sapphire Rapids; the bundled model
# with the shipped adapter, scripts/train.py's stage 2 at 25d7792, docs/training.md): textenv, guide on 24, 25 of 25
# look-ups, 24, 24 of 24 sums, 7 of 8 greetings without a tool; guide off 22, 22, 24, 24, 7. chat, guide on 25, 25,
# 24, 24, 8; guide off (the page's default) 25, 23, 24, 24, 8: its floors are the issue's (look-ups 24, calculator
# and sums 23) or one below today's count where that count is the issue's floor (key phrase 23 -> 22, greetings
# 8 -> 7), so that a greedy token that rounds the other way on another CPU does not fail CI. (protocol, guide) ->
# (kind, measure) -> the least count; a column's protocol and guide are read from its label ("chat, int8, guide off").
FLOORS = {
    ("textenv", "on"): {("look-up", "clean"): 23, ("look-up", "key"): 23, ("arithmetic", "calc"): 23,
                        ("arithmetic", "correct"): 23, ("chit-chat", "no_tool"): 7},
    ("textenv", "off"): {("look-up", "clean"): 20, ("look-up", "key"): 19, ("arithmetic", "calc"): 22,
                         ("arithmetic", "correct"): 21, ("chit-chat", "no_tool"): 7},
    ("chat", "on"): {("look-up", "clean"): 24, ("look-up", "key"): 23, ("arithmetic", "calc"): 23,
                     ("arithmetic", "correct"): 23, ("chit-chat", "no_tool"): 7},
    ("chat", "off"): {("look-up", "clean"): 24, ("look-up", "key"): 22, ("arithmetic", "calc"): 23,
                      ("arithmetic", "correct"): 23, ("chit-chat", "no_tool"): 7},
}


def under_floors(runs: dict[str, dict]) -> list[str]:
    """Each column's counts under their floor, as lines; a column is guided unless its label says "guide off", and
    on textenv unless it starts with "chat, "."""
    under = []
    for name, run in runs.items():
        protocol = "chat" if name.startswith("chat, ") else "textenv"
        floors = FLOORS[protocol, "off" if name.endswith("guide off") else "on"]
        for (kind, key), least in floors.items():
            if (got := run["tallies"][kind].hits(key)) < least:
                under.append(f"- {name}: {kind} {key} {got}, floor {least}")
    return under


def measure(engine: Engine, guide: str, args) -> dict:
    settings = dataclasses.replace(PAGE, guide=guide == "on")
    print(f"\n{engine.backend.name}, guide {guide}: system prompt {len(engine.new_session().cache)} tokens; "
          f"settings: {settings}")
    return run_set(engine, args.set, settings, args.episodes)


def print_table(which: str, runs: dict[str, dict]) -> None:
    def cells(kind: str, key: str) -> str:
        return " | ".join(run["tallies"][kind].rate(key) for run in runs.values())

    print(f"\n| set | questions | measure | {' | '.join(runs)} |\n|---|---|---|{'---|' * len(runs)}")
    look = next(iter(runs.values()))["tallies"]
    print(f"| look-up ({which}) | {len(look['look-up'].rows)} | ended (`<submit>`; chat: EOS) after exactly one "
          f"search | "
          f"{cells('look-up', 'clean')} |")
    if any(keys for _, keys in LOOKUPS[which]):
        print(f"| | | answer holds a key phrase of the definition | {cells('look-up', 'key')} |")
    print(f"| | | reached max_turns or max_length | {cells('look-up', 'limits')} |")
    print(f"| arithmetic ({which}) | {len(look['arithmetic'].rows)} | calculator called | {cells('arithmetic', 'calc')} |")
    print(f"| | | correct | {cells('arithmetic', 'correct')} |")
    print(f"| chit-chat ({which}) | {len(look['chit-chat'].rows)} | no tool call | {cells('chit-chat', 'no_tool')} |")
    print(f"| | | ended with `<submit>` or EOS | {cells('chit-chat', 'ended')} |")
    print(f"| | | reached max_turns or max_length | {cells('chit-chat', 'limits')} |")
    print(f"| | | answer repeats the question word for word | {cells('chit-chat', 'echo')} |")
    print(f"| built-in Batch questions | {len(builtin_questions())} | correct | "
          f"{' | '.join(run['batch'] for run in runs.values())} |")


if __name__ == "__main__":
    raise SystemExit(main())
