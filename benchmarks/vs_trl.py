"""This project vs TRL 0.20.0's TextEnvironment on the same workload, in one invocation.

    python3 benchmarks/vs_trl.py            # builds benchmarks/.trl-venv on first use (~1 min)
    python3 benchmarks/vs_trl.py --chart assets/benchmark_vs_trl.png   # ... and redraws the README's chart

Both sides: the bundled SmolLM2-135M-Instruct (float32; our last column in int8, app/model/int8.py), the same
24-example few-shot calculator prompt, the same 8 questions, greedy, 2 threads, max_new_tokens 32, max_turns 4;
one episode per call, then all 8 as one batch. TRL runs in its own virtual environment (transformers 4.x) as a
subprocess; model loading is excluded on both sides. Prints a table.

TRL's TextEnvironment has no guide, so ours runs with the guide off by default too (like for like), and says so;
`--guide on` runs ours guided (forced text fed in one pass: not the same work as TRL's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import app  # noqa: E402,F401  (before torch: one intra-op thread in every thread but the model's)
import torch  # noqa: E402

import workload  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.backends.local import LocalBackend  # noqa: E402
from app.model.loading import BUNDLED_GGUF, bundled_model_dir, load_model  # noqa: E402
from app.settings import Settings
from app.tools.registry import get_tools  # noqa: E402

SETTINGS = dict(max_new_tokens=32, max_turns=4, max_tool_response=100)


def run_trl(venv: Path, out: Path, threads: int) -> dict:
    subprocess.run(["bash", str(HERE / "make_trl_venv.sh"), str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), str(HERE / "trl_side.py"), "--model-dir", str(bundled_model_dir()),
                    "--gguf-file", BUNDLED_GGUF, "--threads", str(threads), "--json", str(out)], check=True)
    return json.loads(out.read_text())


def episode_text(episode) -> str:
    return "".join(s.text for s in episode.segments)


def run_ours(weights: str, use_cache: bool, draft_tokens: int, guide: bool) -> dict:
    """Per-episode and batch runs on this project's engine (the shared prompt cache is built once, timed apart)."""
    loaded = LocalBackend(load_model(weights=weights))
    try:
        return run_engine(Engine(loaded, tools=get_tools(["Calculator"]), prompt=workload.few_shot_prompt()),
                          use_cache, draft_tokens, guide)
    finally:
        loaded.scheduler.release()  # one model thread (one OpenMP pool) at a time: app.threads


def run_engine(engine: Engine, use_cache: bool, draft_tokens: int, guide: bool = False) -> dict:
    settings = Settings(use_cache=use_cache, draft_tokens=draft_tokens, guide=guide, **SETTINGS)
    began = time.perf_counter()
    engine.new_session(use_cache=use_cache)  # one prefill of the prompt per process, shared by every session
    prompt_seconds = time.perf_counter() - began if use_cache else 0.0
    episodes = []
    for question, expected in workload.QUESTIONS:
        began = time.perf_counter()
        episode = engine.ask(engine.new_session(use_cache=use_cache), question, settings)
        seconds = time.perf_counter() - began
        episodes.append(dict(question=question, expected=expected, answer=episode.answer, seconds=seconds,
                             reward=workload.reward(episode_text(episode), expected),
                             prefill_tokens=episode.prefill_tokens,
                             tool_calls=sum(s.kind == "tool" for s in episode.segments)))
    questions = [q for q, _ in workload.QUESTIONS]
    began = time.perf_counter()
    batch = engine.run(questions, settings,
                       reward_fn=lambda row, ep: workload.reward(episode_text(ep), workload.QUESTIONS[row][1]))
    batch_seconds = time.perf_counter() - began
    seconds = [e["seconds"] for e in episodes]
    return dict(
        prompt_tokens=engine.new_session(use_cache=False).prompt_tokens, prompt_seconds=prompt_seconds,
        episodes=episodes,
        per_episode=dict(mean_seconds=statistics.mean(seconds), median_seconds=statistics.median(seconds),
                         accuracy=statistics.mean(e["reward"] for e in episodes),
                         mean_prefill_tokens=statistics.mean(e["prefill_tokens"] for e in episodes)),
        batch=dict(seconds=batch_seconds, accuracy=statistics.mean(e.reward for e in batch),
                   prefill_tokens=sum(e.prefill_tokens for e in batch)),
    )


def table(trl: dict, ours: dict[str, dict]) -> list[list[str]]:
    t = trl["per_episode"]
    runs = list(ours.values())
    rows = [
        ["prompt tokens", str(trl["prompt_tokens"]), *(str(r["prompt_tokens"]) for r in runs)],
        ["per episode, mean s", f"{t['mean_seconds']:.2f}", *(f"{r['per_episode']['mean_seconds']:.2f}" for r in runs)],
        ["per episode, median s", f"{t['median_seconds']:.2f}",
         *(f"{r['per_episode']['median_seconds']:.2f}" for r in runs)],
        ["ratio to TRL (mean)", "1.00", *(f"{r['per_episode']['mean_seconds'] / t['mean_seconds']:.3f}" for r in runs)],
        ["accuracy", f"{t['accuracy']:.2f}", *(f"{r['per_episode']['accuracy']:.2f}" for r in runs)],
        ["prefill tokens / episode", f"{t['mean_prefill_tokens']:.0f}",
         *(f"{r['per_episode']['mean_prefill_tokens']:.0f}" for r in runs)],
        ["one-time prompt prefill s", "-", *(f"{r['prompt_seconds']:.2f}" if r["prompt_seconds"] else "-" for r in runs)],
    ]
    tb = trl.get("batch") or {}
    if "seconds" in tb:
        rows += [
            ["batch of 8, s", f"{tb['seconds']:.2f}", *(f"{r['batch']['seconds']:.2f}" for r in runs)],
            ["batch ratio to TRL", "1.00", *(f"{r['batch']['seconds'] / tb['seconds']:.3f}" for r in runs)],
            ["batch accuracy", f"{tb['accuracy']:.2f}", *(f"{r['batch']['accuracy']:.2f}" for r in runs)],
            ["batch prefill tokens", str(tb["prefill_tokens"]), *(str(r["batch"]["prefill_tokens"]) for r in runs)],
        ]
    return rows


def chart(trl: dict, ours: dict[str, dict], path: Path, guide: str = "off") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["TRL 0.20.0", *(name.replace(", ", "\n") for name in ours)]
    runs = [trl, *ours.values()]
    seconds = [r["per_episode"]["mean_seconds"] for r in runs]
    prefill = [r["per_episode"]["mean_prefill_tokens"] for r in runs]
    colors = ["#9ca3af", "#f59e0b", "#818cf8", "#4f46e5", "#16a34a"][: len(runs)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for ax, values, title, fmt in ((left, seconds, "seconds per episode (mean of 8)", "{:.2f} s"),
                                   (right, prefill, "tokens prefilled per episode", "{:.0f}")):
        bars = ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize=10)
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"Same workload: SmolLM2-135M, {trl['prompt_tokens']}-token few-shot prompt, "
                 f"8 calculator questions, greedy, 2 CPU threads; ours: guide {guide}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=HERE / ".trl-venv")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-json", type=Path, help="reuse a trl_side.py result instead of running TRL")
    parser.add_argument("--chart", type=Path, help="write the chart (seconds and prefill tokens) to this file")
    parser.add_argument("--guide", choices=("off", "on"), default="off",
                        help="ours with guided answers (default off: TRL's TextEnvironment has no guide)")
    args = parser.parse_args()
    guide = args.guide == "on"
    print(f"ours: guide {args.guide}" + ("" if guide else " (like TRL's TextEnvironment, which has none)"), flush=True)
    os.environ["MODEL_THREADS"] = str(args.threads)  # the scheduler's thread (app.threads)
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    trl = json.loads(args.trl_json.read_text()) if args.trl_json else run_trl(args.venv, out_dir / "trl.json", args.threads)
    ours = {"ours, no cache": run_ours("float32", use_cache=False, draft_tokens=0, guide=guide),
            "ours, cache": run_ours("float32", use_cache=True, draft_tokens=0, guide=guide),
            "ours, cache + drafts": run_ours("float32", use_cache=True, draft_tokens=8, guide=guide),
            "ours, int8, cache + drafts": run_ours("int8", use_cache=True, draft_tokens=8, guide=guide)}
    (out_dir / "ours.json").write_text(json.dumps({"guide": args.guide, **ours}, indent=1))
    header = ["", "TRL 0.20.0", *ours]
    widths = [28] + [max(12, len(h) + 2) for h in header[1:]]
    print("\n" + "".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w) in enumerate(zip(header, widths))))
    for row in table(trl, ours):
        print("".join(f"{v:>{w}}" if i else f"{v:<{w}}" for i, (v, w) in enumerate(zip(row, widths))))
    same = len({json.dumps([e["answer"] for e in r["episodes"]]) for r in ours.values()}) == 1
    print(f"\nsame answers in every run of ours: {same}; ours ran with the guide {args.guide}")
    print(f"versions: TRL side {trl['versions']}; ours torch {torch.__version__}")
    if args.chart:
        chart(trl, ours, args.chart, args.guide)
        print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()
