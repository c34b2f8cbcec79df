"""GRPO on the bundled model with this engine's rollouts (app.training): arithmetic and look-up questions of the
project's tuning ("wide") sets, never the test set, guide off, N steps on CPU. Prints the mean reward of every
step, writes the reward curve (PNG), the per-step log (JSON) and the checkpoint (a model folder: MODEL_ID=<it>
runs it).

    python3 scripts/train.py --steps 12 --out runs/grpo        # then, before/after on the test set:
    MODEL_ID=runs/grpo/checkpoint python3 benchmarks/answer_quality.py --set test --guide off
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from app.backends.local import LocalBackend  # noqa: E402
from app.model.float32 import plain_copy  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.training.rewards import REWARD_FUNCS  # noqa: E402
from app.training.rollout import EngineRollout  # noqa: E402
from benchmarks.answer_quality import ARITHMETIC, LOOKUPS  # noqa: E402


def train_questions(seed: int) -> list[tuple[str, str | None, str]]:
    """(question, expected answer or None, the tool that answers it): the tuning set's sums (ARITHMETIC["wide"])
    and look-ups (LOOKUPS["wide"]), shuffled together: never a test or dev question."""
    sums = [(q, a, "Calculator") for q, a in ARITHMETIC["wide"]]
    lookups = [(q, None, "Search") for q, _ in LOOKUPS["wide"]]
    held_out = {q for q, _ in ARITHMETIC["test"] + ARITHMETIC["dev"] + LOOKUPS["test"] + LOOKUPS["dev"]}
    assert not held_out & {q for q, _, _ in sums + lookups}
    rows = sums + lookups
    random.Random(seed).shuffle(rows)
    return rows


# Each reward as the step line and the curve name it: (short name, TRL's log key, curve label)
REWARDS = (("exact", "rewards/exact_match_reward/mean", "exact match (sums)"),
           ("call", "rewards/well_formed_call_reward/mean", "well-formed call"),
           ("tool", "rewards/expected_tool_reward/mean", "the right tool"))


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [row["reward"] for row in curve], marker="o", label="mean reward (sum of the three)")
    for _, key, label in REWARDS:
        values = [row.get(key) for row in curve]  # (None where no row of the step had this reward: a gap)
        ax.plot(steps, [float("nan") if v is None else v for v in values], marker=".", linestyle="--", label=label)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_title("GRPO on SmolLM2-135M, this engine's rollouts (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--questions-per-step", type=int, default=1)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    parser.add_argument("--protocol", choices=("textenv", "chat"), default="textenv")
    parser.add_argument("--sync", choices=("float32", "int8"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/grpo"))
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from app.threads import model_threads

    torch.set_num_threads(model_threads())  # the trainer's passes (this thread); rollouts never run meanwhile
    loaded = load_model(weights="float32")  # the engine's model (the bundled GGUF, converted to float32)
    policy = plain_copy(loaded.model).train().requires_grad_(True)  # the trainer's: the same weights
    policy.set_attn_implementation("sdpa")  # (torch's own attention for the backward pass)
    backend = LocalBackend(loaded)
    rollout = EngineRollout(backend, protocol=args.protocol, sync=args.sync, guide=False, seed=args.seed)
    rows = train_questions(args.seed)
    data = Dataset.from_dict({"prompt": [q for q, _, _ in rows], "expected": [a for _, a, _ in rows],
                              "tool": [t for _, _, t in rows]})
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=args.questions_per_step * args.num_generations,
        num_generations=args.num_generations, max_steps=args.steps, max_completion_length=args.max_completion_length,
        temperature=args.temperature, learning_rate=args.learning_rate, beta=0.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=args.seed, max_tool_calling_iterations=4,
        disable_tqdm=False, gradient_checkpointing=False)  # (memory is no concern here; the backward is faster)
    curve: list[dict] = []

    class Curve(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                row = {"step": state.global_step, **logs, "rollout_s": rollout.stats.seconds,
                       "sync_s": rollout.stats.sync_seconds[-1] if rollout.stats.sync_seconds else None}
                curve.append(row)
                parts = [f"{name} {mean:.2f}" for name, key, _ in REWARDS
                         if (mean := logs.get(key)) is not None]  # (None: no row of the step had this reward)
                print(f"\nstep {state.global_step}: mean reward {logs['reward']:.3f} ({', '.join(parts)}), loss "
                      f"{logs.get('loss', float('nan')):.4f}, rollouts {rollout.stats.seconds:.1f} s", flush=True)

    trainer = GRPOTrainer(model=policy, reward_funcs=REWARD_FUNCS, args=config, train_dataset=data,
                          processing_class=loaded.tokenizer, rollout_func=rollout, callbacks=[Curve()])
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - began
    checkpoint = args.out / "checkpoint"
    trainer.save_model(str(checkpoint))
    loaded.tokenizer.save_pretrained(str(checkpoint))
    (args.out / "curve.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                      "seconds": seconds, "steps": curve}, indent=1))
    plot(curve, args.out / "reward_curve.png")
    first, last = curve[: max(1, len(curve) // 4)], curve[-max(1, len(curve) // 4):]
    mean = lambda rows: sum(r["reward"] for r in rows) / len(rows)  # noqa: E731
    print(f"\n{len(curve)} steps in {seconds:.0f} s; mean reward of the first quarter {mean(first):.3f}, of the last "
          f"{mean(last):.3f}; checkpoint {checkpoint}, curve {args.out / 'reward_curve.png'}")
    backend.scheduler.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
