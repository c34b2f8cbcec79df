"""The training run's curves from its log (scripts/train.py): the dev set's eval curve per kind over both stages,
stage 1's loss and stage 2's rewards and step times, one PNG."""

from __future__ import annotations

from pathlib import Path


def plot(log: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sft_steps = max((row["step"] for row in log["sft"]), default=0)

    def x(row: dict) -> int:  # one axis over both stages: stage 2's steps follow stage 1's
        return row["step"] + (sft_steps if row["stage"] == "grpo" else 0)

    fig, (evals, losses, rewards, times) = plt.subplots(1, 4, figsize=(19, 4))
    kinds = list(dict.fromkeys(s["kind"] for row in log["evals"] for s in row["scores"]))
    for i, kind in enumerate(kinds):
        points = [(x(row), s) for row in log["evals"] for s in row["scores"] if s["kind"] == kind]
        evals.plot([p for p, _ in points], [s["right"] / s["n"] for _, s in points], marker="o", color=f"C{i}",
                   label=f"{kind}: right")
        evals.plot([p for p, _ in points], [s["tool"] / s["n"] for _, s in points], linestyle=":", marker=".",
                   color=f"C{i}", label=f"{kind}: right tool")
    evals.axvline(sft_steps, color="grey", linewidth=0.8)
    evals.set(title="dev set, unguided (greedy)", xlabel="step (stage 1 SFT, then stage 2 GRPO)",
              ylabel="fraction", ylim=(-0.02, 1.02))
    evals.legend(fontsize=7)
    losses.plot([r["step"] for r in log["sft"]], [r["loss"] for r in log["sft"]])
    losses.set(title="stage 1: SFT loss", xlabel="step", ylabel="cross-entropy")
    grpo = log["grpo"]
    if grpo:
        steps = [r["step"] for r in grpo]
        rewards.plot(steps, [r["reward"] for r in grpo], marker="o", label="reward (weighted)")
        rewards.plot(steps, [r["right"] for r in grpo], marker=".", label="right answer")
        rewards.plot(steps, [r["frac_reward_zero_std"] for r in grpo], linestyle=":", label="groups with zero std")
        rewards.legend(fontsize=7)
        rollout = [r["rollout_s"] for r in grpo]
        sync = [r["sync_s"] or 0.0 for r in grpo]
        passes = [max(0.0, r["step_s"] - a - b) for r, a, b in zip(grpo, rollout, sync)]
        times.bar(steps, rollout, label="rollouts (this engine)")
        times.bar(steps, sync, bottom=rollout, label="weight sync")
        times.bar(steps, passes, bottom=[a + b for a, b in zip(rollout, sync)], label="trainer passes (TRL)")
        times.legend(fontsize=7)
    rewards.set(title="stage 2: GRPO rewards", xlabel="step")
    times.set(title="stage 2: seconds a step", xlabel="step", ylabel="seconds")
    fig.tight_layout()
    path = out / "eval_curve.png"
    fig.savefig(path, dpi=110)
    return path
