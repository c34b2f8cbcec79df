"""Teach the bundled model to do its own work in the chat protocol, on CPU, as a LoRA adapter:

    stage 1  the guide teaches: supervised fine-tuning on this engine's own guided episodes (sums, look-ups,
             chit-chat) in both protocols, the guide told each generated question's call and chit-chat's reply
             written (app.training.teacher), graded first so only right episodes are taught (app.training.sft)
    stage 2  GRPO through TRL's GRPOTrainer with this engine's rollouts (EngineRollout, guide off), aimed at what
             stage 1 leaves: word problems (a quarter of its pool), several operations, powers, percents, negative
             results, exact operands
A dev set (the benchmark's dev questions and a hard split of generated ones) is evaluated unguided every
--eval-every steps: the eval curve. Questions are generated (app.training.questions) and never a test or dev one.

    python3 scripts/train.py                      # both stages, the defaults (~55 min on 2 cores)
    python3 scripts/train.py --out runs/train --adapter-out assets/adapter     # ... and ship the adapter
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from app.backends.local import LocalBackend  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.model.adapter import CONFIG_FILE, TRAINED_FILE, WEIGHTS_FILE  # noqa: E402
from app.model.float32 import plain_copy  # noqa: E402
from app.model.loading import HUB_MODEL_ID, load_model  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.training import questions as gen  # noqa: E402
from app.training.evaluate import evaluate, named_right_tool, right  # noqa: E402
from app.training.questions import Question  # noqa: E402
from app.training.rewards import TASK_REWARD_FUNCS  # noqa: E402
from app.training.rollout import EngineRollout  # noqa: E402
from app.training.sft import Example, SharedPrefixSFT, batches, example  # noqa: E402
from app.training.teacher import replied, teacher_tools  # noqa: E402
from app.training.weights import sync  # noqa: E402
from benchmarks.answer_quality import ARITHMETIC, CHITCHAT, LOOKUPS  # noqa: E402

PROTOCOL = "chat"  # the protocol the adapter is for: stage 2 and the eval curve
TAUGHT = ("chat", "textenv")  # stage 1 teaches both: the adapter answers textenv too (its floors hold)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def held_out() -> list[str]:
    """Every question of the benchmark's test and dev sets: training never sees one."""
    return [q for s in ("test", "dev") for q, _ in ARITHMETIC[s] + LOOKUPS[s]] + CHITCHAT["test"] + CHITCHAT["dev"]


def hard_split(seed: int, which: str) -> list[Question]:
    """Hard sums of their own seed, never trained on: 24 "dev" for the eval curve, 120 "test" for the report (the
    first 24 of them the earlier runs' split: stage 1 already had 23, too few to tell the stages apart)."""
    return gen.hard_sums(random.Random(seed + {"dev": 1000, "test": 2000}[which]), {"dev": 24, "test": 120}[which])


def dev_set(seed: int) -> list[Question]:
    """The benchmark's dev questions and the hard dev split."""
    return ([Question(q, "sum", a) for q, a in ARITHMETIC["dev"]] + hard_split(seed, "dev")
            + [Question(q, "look-up", _headword(q)) for q, _ in LOOKUPS["dev"]]
            + [Question(q, "chit-chat") for q in CHITCHAT["dev"]])


def never_trained(seed: int) -> list[str]:
    """Every question training must not see: the benchmark's test and dev sets and both hard splits."""
    return held_out() + [q.text for w in ("dev", "test") for q in hard_split(seed, w)]


def _headword(question: str) -> str:
    for ask in ("What does {} mean?", "What is the meaning of {}?", "Explain the term {}.", "Define {}.",
                "What is a {}?", "What is an {}?", "What is {}?"):
        head, tail = ask.split("{}")
        if question.startswith(head) and question.endswith(tail):
            return question[len(head): len(question) - len(tail)]
    raise ValueError(f"no headword in {question!r}")


class Run:
    """The policy (LoRA over the float32 model), the engine that samples it, and the log."""

    def __init__(self, args):
        import torch
        from peft import LoraConfig, get_peft_model

        from app.threads import model_threads

        torch.set_num_threads(model_threads())
        torch.manual_seed(args.seed)
        self.args, self.began = args, time.perf_counter()
        self.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()  # (the code that trains: a run takes most of an hour)
        self.loaded = load_model(weights="float32", adapter=False)  # (the base: ADAPTER has the shipped one)
        self.backend = LocalBackend(self.loaded)
        base = plain_copy(self.loaded.model).train()
        base.set_attn_implementation("sdpa")
        if args.init_adapter is not None:
            from peft import PeftModel

            self.policy = PeftModel.from_pretrained(base, str(args.init_adapter), is_trainable=True)
        else:
            self.policy = get_peft_model(base, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                          lora_dropout=0.0, target_modules=LORA_TARGETS))
        self.engine = Engine(self.backend, protocol=PROTOCOL)
        self.dev = dev_set(args.seed)
        self.log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "evals": [], "sft": [], "grpo": []}

    def seconds(self) -> float:
        return time.perf_counter() - self.began

    def sync(self) -> None:
        """The engine samples the policy's current weights (the adapter merged in)."""
        self.backend, _ = sync(self.backend, self.policy, "float32")
        self.engine = Engine(self.backend, protocol=PROTOCOL)

    def evaluate(self, stage: str, step: int) -> dict:
        self.sync()
        began = time.perf_counter()
        scores, episodes = evaluate(self.engine, self.dev, Settings(max_new_tokens=64))
        row = {"stage": stage, "step": step, "seconds": round(time.perf_counter() - began, 1),
               "at": round(self.seconds()), "scores": [s.to_json() for s in scores]}
        self.log["evals"].append(row)
        print(f"eval {stage} {step}: " + ", ".join(f"{s.kind} tool {s.tool}/{s.n} right {s.right}/{s.n}"
                                                    for s in scores) + f" ({row['seconds']} s)", flush=True)
        self.log.setdefault("episodes", {})[f"{stage} {step}"] = [
            {"q": q.text, "right": right(q, e), "tool": named_right_tool(q, e),
             "segments": [[s.kind, s.text] for s in e.segments]} for q, e in zip(self.dev, episodes)]
        return row

    def report(self, stage: str) -> None:
        """After a stage: the hard test split (never trained on, never in the curve), stage 2's part apart from 1's;
        and the dev set in textenv, the other protocol the adapter answers in."""
        self.sync()
        [score], _ = evaluate(self.engine, hard_split(self.args.seed, "test"), Settings(max_new_tokens=64))
        self.log.setdefault("hard_test", {})[stage] = score.to_json()
        print(f"hard test split after {stage}: tool {score.tool}/{score.n}, right {score.right}/{score.n}", flush=True)
        scores, _ = evaluate(Engine(self.backend, protocol="textenv"), self.dev, Settings(max_new_tokens=64))
        self.log.setdefault("textenv_dev", {})[stage] = [s.to_json() for s in scores]
        print(f"textenv dev set after {stage}: " + ", ".join(f"{s.kind} tool {s.tool}/{s.n} right {s.right}/{s.n}"
                                                            for s in scores), flush=True)

    def save(self) -> None:
        (self.args.out / "log.json").write_text(json.dumps(self.log, indent=1))


def teacher_examples(run: Run, questions: list[Question], protocol: str) -> tuple[list[int], list]:
    """The protocol's system prompt ids and the teacher's examples for `questions` in it: the guide's episodes, the
    guide told each one's call (app.training.teacher), graded (only those that answered right with the right tool
    teach); chit-chat with its written reply."""
    began = time.perf_counter()
    teacher = Engine(run.backend, tools=teacher_tools(run.engine.tools, questions), protocol=protocol)
    episodes = teacher.run([q.text for q in questions], Settings(max_new_tokens=64), guide=True)

    def taught(question: Question, episode) -> Example | None:
        if question.reply is not None:
            return replied(episode, question.reply, run.loaded.tokenizer)
        return example(episode) if right(question, episode) and named_right_tool(question, episode) else None

    kept = [(q, ex) for q, e in zip(questions, episodes) if (ex := taught(q, e)) is not None]
    by_kind = {k: sum(1 for q, _ in kept if q.kind == k) for k in dict.fromkeys(q.kind for q in questions)}
    print(f"teacher ({protocol}): {len(kept)} of {len(questions)} guided episodes right (chit-chat: ended without "
          f"a call, its reply written), by kind {by_kind}", flush=True)
    run.log.setdefault("teacher", {})[protocol] = {"questions": len(questions), "kept": len(kept), "by_kind": by_kind,
                                                   "seconds": round(time.perf_counter() - began, 1)}
    session = teacher.new_session()
    return list(session.cache.ids)[: session.prompt_tokens], [ex for _, ex in kept]


def plan(steps: int, share: float) -> list[str]:
    """Which protocol each of stage 1's steps teaches: textenv on `share` of them, spread evenly."""
    return ["textenv" if int((i + 1) * share) > int(i * share) else PROTOCOL for i in range(steps)]


def stage_sft(run: Run) -> None:
    args = run.args
    rng = random.Random(args.seed)
    questions = gen.without(gen.plain_sums(rng, args.sft_sums) + gen.hard_sums(rng, args.sft_hard)
                            + gen.lookups(rng, args.sft_lookups, avoid=held_out()) + gen.chitchat(rng, len(gen.CHITCHAT)),
                            never_trained(args.seed))
    gen.disjoint(questions, never_trained(args.seed))
    taught = {protocol: teacher_examples(run, questions, protocol) for protocol in TAUGHT}
    sft = SharedPrefixSFT(run.policy, taught[PROTOCOL][0], args.sft_lr, run.loaded.tokenizer.eos_token_id)
    streams = {protocol: batches(examples, args.sft_batch, args.seed) for protocol, (_, examples) in taught.items()}
    from tqdm import tqdm

    for step, protocol in zip(tqdm(range(1, args.sft_steps + 1), desc="stage 1 (SFT)"),
                              plan(args.sft_steps, args.sft_textenv_share)):
        began = time.perf_counter()
        loss = sft.step(next(streams[protocol]), taught[protocol][0])
        run.log["sft"].append({"step": step, "protocol": protocol, "loss": loss,
                               "seconds": round(time.perf_counter() - began, 2)})
        if step % args.eval_every == 0 or step == args.sft_steps:
            run.evaluate("sft", step)
            run.save()


def aimed(run: Run, pool: list[Question], samples: int) -> list[Question]:
    """The questions of `pool` whose `samples` unguided samples at the stage's temperature disagree (some right,
    some wrong): only such a group has a reward spread for GRPO to learn from."""
    run.sync()
    settings = Settings(max_new_tokens=64, temperature=run.args.temperature, seed=run.args.seed)
    episodes = run.engine.run([q.text for q in pool for _ in range(samples)], settings, guide=False)
    hits = [sum(right(q, e) for e in episodes[i * samples:(i + 1) * samples]) for i, q in enumerate(pool)]
    kept = [q for q, n in zip(pool, hits) if 0 < n < samples]
    by_kind = {k: f"{sum(q.kind == k for q in kept)}/{sum(q.kind == k for q in pool)}"
               for k in dict.fromkeys(q.kind for q in pool)}
    print(f"aimed: {len(kept)} of {len(pool)} questions had mixed outcomes in {samples} samples "
          f"({sum(n == 0 for n in hits)} always wrong), by kind {by_kind}", flush=True)
    run.log["aimed"] = {"pool": len(pool), "kept": len(kept), "always_wrong": sum(n == 0 for n in hits),
                        "samples": samples, "by_kind": by_kind}
    return kept


def stage_grpo(run: Run) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args = run.args
    rng = random.Random(args.seed + 1)
    pool = gen.without(gen.word_problems(rng, args.grpo_pool // 4) + gen.hard_sums(rng, args.grpo_pool // 4)
                       + gen.plain_sums(rng, args.grpo_pool // 8)
                       + gen.lookups(rng, args.grpo_pool // 4, held_out()) + gen.chitchat(rng, args.grpo_pool // 8),
                       never_trained(args.seed))
    gen.disjoint(pool, never_trained(args.seed))
    began = time.perf_counter()
    kept = aimed(run, pool, samples=args.generations) or pool
    run.log["aimed"]["seconds"] = round(time.perf_counter() - began, 1)
    need = args.grpo_steps * args.questions_per_step
    rng.shuffle(kept)
    questions = (kept * (need // len(kept) + 1))[:need]  # (cycled where fewer than the run asks)
    data = Dataset.from_dict({"prompt": [q.text for q in questions], "kind": [q.kind for q in questions],
                              "expected": [q.expected for q in questions]})
    rollout = EngineRollout(run.backend, protocol=PROTOCOL, sync="float32", guide=False, seed=args.seed)
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=args.questions_per_step,  # (one group a pass: 8 rows of ~1,150 tokens took 24 GB)
        num_generations=args.generations, max_steps=args.grpo_steps, max_completion_length=96,
        temperature=args.temperature, learning_rate=args.grpo_lr, beta=0.0, logging_steps=1,
        reward_weights=[1.0, 0.25], report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=args.seed,
        max_tool_calling_iterations=2, disable_tqdm=False, gradient_checkpointing=True)

    class Log(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                row = {"step": state.global_step, "reward": logs["reward"],
                       "frac_reward_zero_std": logs.get("frac_reward_zero_std"),
                       "right": logs.get("rewards/right_answer_reward/mean"), "loss": logs.get("loss"),
                       "rollout_s": round(rollout.stats.seconds, 2),
                       "sync_s": round(rollout.stats.sync_seconds[-1], 2) if rollout.stats.sync_seconds else None,
                       "step_s": round(logs.get("step_time", 0.0) or 0.0, 2), "at": round(run.seconds())}
                run.log["grpo"].append(row)
                print(f"\nstep {row['step']}: reward {row['reward']:.3f}, right {row['right']}, zero-std "
                      f"{row['frac_reward_zero_std']}, rollouts {row['rollout_s']} s", flush=True)

        def on_step_end(self, _args, state, _control, **_):
            if state.global_step % args.grpo_eval_every == 0 or state.global_step == args.grpo_steps:
                run.backend = rollout.backend
                run.evaluate("grpo", state.global_step)
                run.save()

    trainer = GRPOTrainer(model=run.policy, reward_funcs=TASK_REWARD_FUNCS, args=config, train_dataset=data,
                          processing_class=run.loaded.tokenizer, rollout_func=rollout, callbacks=[Log()])
    trainer.train()


def ship(run: Run, folder: Path, stage: str) -> None:
    """The policy's adapter after `stage`, in the shipped form (`shippable`)."""
    run.policy.save_pretrained(str(folder))
    shippable(folder, " ".join(["python3 scripts/train.py", *sys.argv[1:]]), stage, run.commit)


def shippable(folder: Path, command: str, stage: str, commit: str) -> None:
    """A saved peft adapter as assets/adapter holds it: float16 weights (half the bytes; merged at load into
    float32), the hub id as its base, and what trained it (TRAINED_FILE)."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / CONFIG_FILE).read_text())  # (the hub id, not this machine's cache path)
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "base_model_name_or_path": HUB_MODEL_ID}, indent=2))
    weights = folder / WEIGHTS_FILE
    save_file({k: v.to(torch.float16) for k, v in load_file(weights).items()}, weights)
    (folder / TRAINED_FILE).write_text(json.dumps({"command": command, "stage": stage, "commit": commit,
                                                   "protocol": PROTOCOL}, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--sft-textenv-share", type=float, default=1 / 3,
                        help="the share of stage 1's steps on textenv episodes (the rest: chat)")
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--sft-sums", type=int, default=64)
    parser.add_argument("--sft-hard", type=int, default=64)
    parser.add_argument("--sft-lookups", type=int, default=80)
    parser.add_argument("--grpo-steps", type=int, default=16)
    parser.add_argument("--questions-per-step", type=int, default=2)
    parser.add_argument("--grpo-pool", type=int, default=192, help="generated questions stage 2 is aimed from")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--grpo-lr", type=float, default=5e-4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--grpo-eval-every", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-adapter", type=Path, default=None,
                        help="start from this saved adapter (e.g. runs/train/adapter-sft with --sft-steps 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/train"))
    parser.add_argument("--adapter-out", type=Path, default=None, help="also write the adapter here (assets/adapter)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    run.evaluate("start", 0)
    run.report("start")
    if args.sft_steps:
        stage_sft(run)
        run.report("sft")
        ship(run, args.out / "adapter-sft", "1 (SFT)")
    if args.grpo_steps:
        stage_grpo(run)
        run.report("grpo")
    last = "2 (GRPO)" if args.grpo_steps else "1 (SFT)"
    ship(run, args.out / "adapter", last)
    if args.adapter_out:
        ship(run, args.adapter_out, last)
    run.log["seconds"] = round(run.seconds())
    run.save()
    from training_plots import plot

    plot(run.log, args.out)
    print(f"done in {run.seconds():.0f} s: {args.out / 'log.json'}, {args.out / 'eval_curve.png'}, "
          f"adapter {args.out / 'adapter'}")
    run.backend.scheduler.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
