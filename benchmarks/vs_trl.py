"""This project vs TRL 0.20.0's TextEnvironment on the same workload, in one invocation.

    python3 benchmarks/vs_trl.py            # builds benchmarks/.trl-venv on first use (~1 min)

Both sides: the bundled SmolLM2-135M-Instruct (float32), the same 24-example few-shot calculator prompt, the
same 8 questions, greedy, 2 threads, max_new_tokens 32, max_turns 4; one episode per call, then all 8 as one
batch. TRL runs in its own virtual environment (transformers 4.x) as a subprocess; model loading is excluded
on both sides. Prints a table and writes assets/benchmark_vs_trl.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import workload  # noqa: E402
from app.engine import Engine, Settings  # noqa: E402
from app.model import BUNDLED_GGUF, bundled_model_dir, load_model  # noqa: E402
from app.tools.registry import get_tools  # noqa: E402

SETTINGS = dict(max_new_tokens=32, max_turns=4, max_tool_response=100)
CHART = ROOT / "assets" / "benchmark_vs_trl.png"


def run_trl(venv: Path, out: Path, threads: int) -> dict:
    subprocess.run(["bash", str(HERE / "make_trl_venv.sh"), str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), str(HERE / "trl_side.py"), "--model-dir", str(bundled_model_dir()),
                    "--gguf-file", BUNDLED_GGUF, "--threads", str(threads), "--json", str(out)], check=True)
    return json.loads(out.read_text())


def episode_text(episode) -> str:
    return "".join(s.text for s in episode.segments)


def run_ours(use_cache: bool) -> dict:
    """Per-episode and batch runs on this project's engine (the shared prompt cache is built once, timed apart)."""
    engine = Engine(load_model(), tools=get_tools(["Calculator"]), prompt=workload.few_shot_prompt())
    settings = Settings(use_cache=use_cache, **SETTINGS)
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


def table(trl: dict, on: dict, off: dict) -> list[tuple[str, str, str, str]]:
    t, a, b = trl["per_episode"], on["per_episode"], off["per_episode"]
    rows = [
        ("prompt tokens", str(trl["prompt_tokens"]), str(on["prompt_tokens"]), str(off["prompt_tokens"])),
        ("per episode, mean s", f"{t['mean_seconds']:.2f}", f"{a['mean_seconds']:.2f}", f"{b['mean_seconds']:.2f}"),
        ("per episode, median s", f"{t['median_seconds']:.2f}", f"{a['median_seconds']:.2f}",
         f"{b['median_seconds']:.2f}"),
        ("ratio to TRL (mean)", "1.00", f"{a['mean_seconds'] / t['mean_seconds']:.3f}",
         f"{b['mean_seconds'] / t['mean_seconds']:.3f}"),
        ("accuracy", f"{t['accuracy']:.2f}", f"{a['accuracy']:.2f}", f"{b['accuracy']:.2f}"),
        ("prefill tokens / episode", f"{t['mean_prefill_tokens']:.0f}", f"{a['mean_prefill_tokens']:.0f}",
         f"{b['mean_prefill_tokens']:.0f}"),
        ("one-time prompt prefill s", "-", f"{on['prompt_seconds']:.2f}", "-"),
    ]
    if trl.get("batch") and "seconds" in trl["batch"]:
        tb = trl["batch"]
        rows += [
            ("batch of 8, s", f"{tb['seconds']:.2f}", f"{on['batch']['seconds']:.2f}", f"{off['batch']['seconds']:.2f}"),
            ("batch ratio to TRL", "1.00", f"{on['batch']['seconds'] / tb['seconds']:.3f}",
             f"{off['batch']['seconds'] / tb['seconds']:.3f}"),
            ("batch accuracy", f"{tb['accuracy']:.2f}", f"{on['batch']['accuracy']:.2f}",
             f"{off['batch']['accuracy']:.2f}"),
            ("batch prefill tokens", str(tb["prefill_tokens"]), str(on["batch"]["prefill_tokens"]),
             str(off["batch"]["prefill_tokens"])),
        ]
    return rows


def chart(trl: dict, on: dict, off: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["TRL 0.20.0", "TextEnv Chat\ncache off", "TextEnv Chat\ncache on"]
    seconds = [trl["per_episode"]["mean_seconds"], off["per_episode"]["mean_seconds"], on["per_episode"]["mean_seconds"]]
    prefill = [trl["per_episode"]["mean_prefill_tokens"], off["per_episode"]["mean_prefill_tokens"],
               on["per_episode"]["mean_prefill_tokens"]]
    colors = ["#9ca3af", "#f59e0b", "#4f46e5"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=110)
    for ax, values, title, fmt in ((left, seconds, "seconds per episode (mean of 8)", "{:.2f} s"),
                                   (right, prefill, "tokens prefilled per episode", "{:.0f}")):
        bars = ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize=10)
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=8)
    fig.suptitle("Same workload: SmolLM2-135M, 1,159-token few-shot prompt, 8 calculator questions, 2 CPU threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=HERE / ".trl-venv")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-json", type=Path, help="reuse a trl_side.py result instead of running TRL")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    trl = json.loads(args.trl_json.read_text()) if args.trl_json else run_trl(args.venv, out_dir / "trl.json", args.threads)
    on, off = run_ours(use_cache=True), run_ours(use_cache=False)
    (out_dir / "ours.json").write_text(json.dumps({"cache_on": on, "cache_off": off}, indent=1))
    rows = table(trl, on, off)
    print(f"\n{'':28}{'TRL 0.20.0':>12}{'ours, cache':>14}{'ours, no cache':>16}")
    for name, *values in rows:
        print(f"{name:28}{values[0]:>12}{values[1]:>14}{values[2]:>16}")
    print(f"\nversions: TRL side {trl['versions']}; ours torch {torch.__version__}")
    chart(trl, on, off, CHART)
    print(f"chart: {CHART.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
