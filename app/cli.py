"""Command line: run episodes (`ask`) or a single tool (`tool`); user mistakes print one line to stderr. `--help`,
`tool` and argument errors never import torch, transformers or gradio."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from app.episode import Episode, EpisodeFinished, SegmentFinished, TextDelta, count_text
from app.settings import DEFAULT_MAX_LENGTH, PROTOCOLS, Settings, clean_question


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one `error:` line like every other mistake (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m app", description="TextEnv Chat: a model that answers in "
                                     "segments and calls tools between them.")
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask", help="answer questions (several run as one batch)")
    ask.add_argument("questions", nargs="+", metavar="QUESTION")
    ask.add_argument("--no-cache", action="store_true", help="recompute everything for every segment")
    ask.add_argument("--guide", action=argparse.BooleanOptionalAction, default=Settings.guide,
                     help="guided answers: a grammar per segment keeps it to the protocol and opens the answer with "
                          "the tool's result; --no-guide lets the model write alone (default: off)")
    ask.add_argument("--max-length", type=int, help=f"token budget of the session (default: {DEFAULT_MAX_LENGTH}, "
                                                    "or the backend's context where that is shorter)")
    ask.add_argument("--max-new-tokens", type=int, default=Settings.max_new_tokens, help="tokens per segment")
    ask.add_argument("--max-turns", type=int, default=Settings.max_turns, help="tool calls per answer")
    ask.add_argument("--max-tool-response", type=int, default=Settings.max_tool_response, help="characters")
    ask.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    ask.add_argument("--seed", type=int, default=0)
    ask.add_argument("--draft-tokens", type=int, default=8,
                     help="greedy only: tokens proposed by prompt lookup and verified in one pass (0 = off)")
    ask.add_argument("--prompt", type=Path,
                     help="a few-shot system prompt file ({tools} lists the tools; {abilities}, {actions} name them)")
    ask.add_argument("--tools", help="comma-separated tool names, e.g. Calculator,Search")
    ask.add_argument("--protocol", choices=PROTOCOLS, default=None,
                     help="how model and tools talk: textenv (TRL TextEnvironment markers), chat (the model's chat "
                          "template with tools, <tool_call> JSON) or auto (default: the PROTOCOL environment "
                          "variable, else auto: chat where the model's own template renders tools)")
    ask.add_argument("--json", action="store_true", help="one JSON object per question, one per line")
    tool = sub.add_parser("tool", help="run one tool and print what the model would read")
    tool.add_argument("name")
    tool.add_argument("input")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _tool(args) if args.command == "tool" else _ask(args)
    except (ValueError, OSError) as error:  # InputError and BackendError (a model server's failure) are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 2


def _tool(args) -> int:
    from app.tools.registry import default_tools, run_tool

    result = run_tool(default_tools(), args.name, args.input)
    if not result.ok:
        print(result.text if result.text.startswith("error:") else f"error: {result.text}", file=sys.stderr)
        return 1
    print(result.text)
    return 0


def _ask(args) -> int:
    from app.tools.registry import get_tools

    settings = Settings(max_new_tokens=args.max_new_tokens, max_length=args.max_length, max_turns=args.max_turns,
                        max_tool_response=args.max_tool_response, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, use_cache=not args.no_cache, seed=args.seed,
                        draft_tokens=args.draft_tokens, guide=args.guide, protocol=args.protocol)
    # Everything a user can get wrong is checked before the model loads (seconds).
    settings = settings.validated(context_limit=10**6)
    settings = dataclasses.replace(settings, max_length=args.max_length)  # (None: resolved once the backend loads)
    for question in args.questions:
        clean_question(question)
    tools = get_tools(args.tools.split(",") if args.tools else None)
    prompt = args.prompt.read_text(encoding="utf-8") if args.prompt else None
    from app.backends.select import load_backend  # the model stack (torch, transformers): only past the checks above
    from app.engine.engine import Engine
    from app.episode import in_row_order

    engine = Engine(load_backend(), tools=tools, prompt=prompt, protocol=settings.protocol)
    settings = settings.validated(engine.context_limit)  # (--max-length not given: what fits this backend)
    failed: list[int] = []  # rows whose model or server failed mid-answer: the exit status says so, as the text does
    for event in in_row_order(engine.stream_batch(args.questions, settings)):  # the rows run at once
        if isinstance(event, EpisodeFinished) and event.episode.error is not None:
            failed.append(event.row)
        if args.json:
            if isinstance(event, EpisodeFinished):
                print(json.dumps(event.episode.to_json(), ensure_ascii=False), flush=True)
        elif isinstance(event, TextDelta):
            print(event.text, end="", flush=True)
        elif isinstance(event, SegmentFinished):
            print(_describe(event.segment), flush=True)
        elif isinstance(event, EpisodeFinished):
            print(_summary(event.episode), flush=True)
    if failed:  # (every answer was printed: one failed row costs no other its answer)
        which = "; ".join(f"{row + 1} ({args.questions[row]!r})" for row in failed)
        print(f"error: {len(failed)} of {len(args.questions)} answers failed: question {which}", file=sys.stderr)
    return 1 if failed else 0


def _describe(segment) -> str:
    if segment.kind == "tool":
        return f"{segment.text}\n  [tool {segment.tool or '?'}: {segment.query!r} -> {'ok' if segment.ok else 'error'}]"
    guided = f" · {segment.guided_label}" if segment.guided_label else ""
    return (f"\n  [{segment.stop.label} · {count_text(segment.prefill_tokens)} new tokens prefilled, "
            f"{count_text(segment.cached_tokens)} reused · {segment.generated_tokens} generated · {segment.ms:.0f} ms"
            f"{guided}]")


def _summary(episode: Episode) -> str:
    note = f"  [{Episode.UNRUN_NOTE}]\n" if episode.unrun_call else ""
    note += f"\n  [error: {episode.error}]\n" if episode.error is not None else ""  # (after the text streamed)
    return (f"{note}answer: {episode.answer}\n  [{episode.total_tokens} tokens in session · prefilled "
            f"{count_text(episode.prefill_tokens)}, reused {count_text(episode.reused_tokens)} · {episode.ms:.0f} ms · "
            f"{episode.backend}]\n")
