"""The policy's weights into the engine (app.training.weights), both ways, on the bundled model: the seconds a
sync takes, and the gap between the rollouts' logprobs and the trainer's own recomputation of the same tokens
(log_softmax(logits / temperature) of a plain forward pass, as TRL computes them), mean and max |Δ| over the
policy's tokens of one batch. That gap is what TRL's importance-sampling correction would have to absorb.

    python3 benchmarks/weight_sync.py              # float32 (in-place copy) and int8 (quantized again)
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from app.backends.local import LocalBackend  # noqa: E402
from app.model.float32 import plain_copy  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.training.rollout import EngineRollout  # noqa: E402
from benchmarks.answer_quality import ARITHMETIC  # noqa: E402


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return f"{name}, {torch.get_num_threads()} threads"


def fake_trainer(policy, step: int, temperature: float, max_completion_length: int):
    """What EngineRollout reads of a GRPOTrainer: its state's global_step, its model, its sampling settings."""
    return SimpleNamespace(state=SimpleNamespace(global_step=step), model=policy,
                           accelerator=SimpleNamespace(unwrap_model=lambda m: m), temperature=temperature, top_p=1.0,
                           top_k=0, max_completion_length=max_completion_length, max_tool_calling_iterations=4)


def recomputed(policy, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        logits = policy(ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--modes", nargs="+", choices=("float32", "int8"), default=["float32", "int8"])
    args = parser.parse_args()

    loaded = load_model(weights="float32")
    policy = plain_copy(loaded.model)  # (the trainer's modules: torch's linear, not the engine's packed one)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained step's worth of change, so the sync copies new weights
        for p in policy.parameters():
            p.add_(1e-4 * torch.randn(p.shape, generator=gen))
    questions = [q for q, _ in ARITHMETIC["wide"][: args.questions]]
    prompts = [q for q in questions for _ in range(args.num_generations)]
    print(f"CPU: {cpu_name()}; {len(questions)} questions x {args.num_generations} generations, temperature "
          f"{args.temperature}, max_completion_length {args.max_completion_length}, textenv, guide off")
    print(f"{'sync':8} {'sync s (mean of 2)':>18} {'rollout s':>10} {'tokens':>7} {'mean |Δ|':>10} {'max |Δ|':>10}")
    for mode in args.modes:
        backend = LocalBackend(copy.deepcopy(loaded)) if mode == "float32" else LocalBackend(loaded)
        rollout = EngineRollout(backend, sync=mode, seed=1)
        for step in (1, 2):  # (two syncs: the second's time is a steady one)
            out = rollout(prompts, fake_trainer(policy, step, args.temperature, args.max_completion_length))
        deltas = []
        for prompt, completion, logprobs, mask in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                                      out["env_mask"]):
            want = recomputed(policy, prompt, completion, args.temperature)
            got = torch.tensor(logprobs)
            deltas += [abs(float(d)) for d, m in zip(got - want, mask) if m]
        sync_s = statistics.mean(rollout.stats.sync_seconds)
        print(f"{mode:8} {sync_s:18.2f} {rollout.stats.seconds:10.1f} {len(deltas):7d} "
              f"{statistics.mean(deltas):10.2e} {max(deltas):10.2e}", flush=True)
        rollout.backend.scheduler.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
