"""Stage 1's step (scripts/train.py) against TRL's SFTTrainer on the same examples, LoRA and batch: this engine's
guided chat episodes after the shared 1,050-token system prompt, loss on the model's and the guide's tokens.

    python3 benchmarks/sft_step.py --examples 8 --steps 3

SharedPrefixSFT runs the system prompt once a step without gradient; SFTTrainer gets every example as one
pre-tokenized sequence (prompt + turn, `completion_mask` on the learned tokens, completion_only_loss) and runs
the whole of it through the forward and backward pass. Prints seconds a step and tokens through the model."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from app.backends.local import LocalBackend  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.model.float32 import plain_copy  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.threads import model_threads  # noqa: E402
from app.training import questions as gen  # noqa: E402
from app.training.sft import IGNORE, SharedPrefixSFT, example  # noqa: E402


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(plain_copy(model).train(), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(model_threads())
    loaded = load_model(weights="float32")
    engine = Engine(LocalBackend(loaded), protocol="chat")
    rng = random.Random(0)
    questions = gen.plain_sums(rng, args.examples // 2) + gen.lookups(rng, args.examples - args.examples // 2)
    examples = [example(e) for e in engine.run([q.text for q in questions], Settings(), guide=True)]
    session = engine.new_session()
    prompt = list(session.cache.ids)[: session.prompt_tokens]
    turn_tokens = sum(len(e.ids) for e in examples)

    ours = SharedPrefixSFT(lora(loaded.model), prompt, 5e-4, loaded.tokenizer.eos_token_id)
    ours.step(examples)  # (warm-up)
    began = time.perf_counter()
    for _ in range(args.steps):
        ours.step(examples)
    ours_s = (time.perf_counter() - began) / args.steps

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": [prompt + e.ids for e in examples],
                              "completion_mask": [[0] * len(prompt) + [int(t != IGNORE) for t in e.labels]
                                                  for e in examples]})
    config = SFTConfig(output_dir="/tmp/sft_step_bench", per_device_train_batch_size=len(examples),
                       max_steps=args.steps + 1, learning_rate=5e-4, completion_only_loss=True, max_length=None,
                       logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                       disable_tqdm=True, padding_free=False)
    times: list[float] = []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.began)

    trainer = SFTTrainer(model=lora(loaded.model), args=config, train_dataset=data,
                         processing_class=loaded.tokenizer, callbacks=[Clock()])
    trainer.train()
    trl_s = sum(times[1:]) / len(times[1:])  # (the first step warms up, as ours did)
    print(f"{len(examples)} examples, {turn_tokens} turn tokens after a {len(prompt)}-token system prompt")
    print(f"| step | seconds a step | tokens through the model a step |\n|---|---|---|\n"
          f"| SharedPrefixSFT (prompt once, no gradient) | {ours_s:.2f} | {len(prompt)} + {turn_tokens} |\n"
          f"| TRL SFTTrainer (whole sequences) | {trl_s:.2f} | {len(prompt) * len(examples) + turn_tokens} |\n"
          f"ratio {ours_s / trl_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
