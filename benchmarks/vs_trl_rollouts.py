"""One GRPO step's rollouts, TRL's own tool loop against this engine's rollout function (app.training), in one
run: the same questions, model, chat template and tools, sampling settings and num_generations.

    python3 benchmarks/vs_trl_rollouts.py                       # num_generations 1, 4, 8
    python3 benchmarks/vs_trl_rollouts.py --generations 8 --questions 2
    python3 benchmarks/vs_trl_rollouts.py --onednn-peer          # also TRL on oneDNN's packed linears

TRL: `GRPOTrainer(tools=[calculator, search])` (TRL 1.16, no vLLM), its rollouts as a training step makes them
(`trainer._generate(prompts)`: generate, parse the calls with the tokenizer's response template, run the tools,
generate again on the whole prompt + completion + tool output), on plain `generate` and, where it runs, on
transformers' continuous batching (`--continuous`); with `--onednn-peer` also plain generate on a policy whose
linears multiply on oneDNN's packed weights as ours do in float32 (not TRL's own path; it shows how much of the
gap is the matmul library). Ours: EngineRollout on the chat protocol (the same template,
assets/chat_template.jinja, and the same system prompt and examples), float32 and int8, guide off. Prints per
run the wall time of the step's rollouts, the tokens fed through the model (prefill), completions per second and
the ratio of ours to TRL's plain generate. Model loading is outside the timings.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from app.backends.local import LocalBackend  # noqa: E402
from app.model.float32 import plain_copy, to_packed  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.paths import ASSETS  # noqa: E402
from app.protocols.chat_prompt import chat_messages, default_chat_template  # noqa: E402
from app.tools import functions  # noqa: E402
from app.tools.registry import default_tools  # noqa: E402
from app.training.rollout import EngineRollout  # noqa: E402
from benchmarks.answer_quality import ARITHMETIC  # noqa: E402
from benchmarks.weight_sync import cpu_name  # noqa: E402

# transformers' response template (>= 5.13) for the project's template: `<tool_call>[{...}]</tool_call>`, one call
# per tag as the bundled model writes them, then the answer's text up to <|im_end|>
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>[", "close_pattern": r"\]</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def trl_trainer(model, tokenizer, args, generations: int, rows: int, continuous: bool):
    """A GRPOTrainer whose `_generate` makes one completion per prompt it is given (its transformers paths do not
    repeat them: the sampler does), so a config of 2 generations also times 1 (GRPOConfig refuses 1)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    generations = max(2, generations)
    rows = max(rows, generations)

    config = GRPOConfig(output_dir="benchmarks/out/vs_trl_rollouts", per_device_train_batch_size=rows,
                        num_generations=generations, max_completion_length=args.max_completion_length,
                        temperature=args.temperature, max_tool_calling_iterations=args.max_turns, beta=0.0,
                        report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                        use_transformers_continuous_batching=continuous)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * rows})
    return GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=config,
                       train_dataset=data, processing_class=tokenizer,
                       tools=[functions.calculator, functions.search])


def run_trl(trainer, prompts: list) -> dict:
    """TRL's rollouts of one step: the seconds, the tokens it fed through the model (every generate call's
    inputs: no cache is kept between calls), the tool calls."""
    fed = []
    single_turn = trainer._generate_single_turn

    def counted(prompt_ids, *a, **k):
        fed.append(sum(len(p) for p in prompt_ids))
        return single_turn(prompt_ids, *a, **k)

    trainer._generate_single_turn = counted
    # the per-rollout tool dicts _generate_and_score_completions builds before it calls _generate (TRL 1.16)
    trainer._sync_tool_dicts = [{tool.__name__: tool for tool in trainer._standalone_tools} for _ in prompts]
    trainer._async_tool_dicts = [{} for _ in prompts]
    torch.manual_seed(0)
    began = time.perf_counter()
    with torch.no_grad():
        _, completion_ids, mask, *_ = trainer._generate(prompts)
    seconds = time.perf_counter() - began
    trainer._generate_single_turn = single_turn
    mode = "train" if trainer.model.training else "eval"  # (the key _generate logs its metrics under)
    calls = trainer._metrics[mode]["tools/call_frequency"][-1]
    return dict(seconds=seconds, prefill=sum(fed), rows=len(completion_ids), calls=calls,
                generated=sum(sum(m) for m in mask) if mask is not None else sum(map(len, completion_ids)),
                tool_tokens=sum(len(m) - sum(m) for m in mask) if mask is not None else 0)


def run_ours(rollout: EngineRollout, policy, questions: list[str], generations: int, args) -> dict:
    """One training step's rollouts as GRPOTrainer would call them: at a new global_step, so the engine first takes
    the policy's weights (the sync, timed apart) and prefills the system prompt again from them (timed: TRL's
    generate computes it too), then runs every completion."""
    step = (rollout.stats.synced_step or 0) + 1
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=step), temperature=args.temperature,
                              top_p=1.0, top_k=0, max_completion_length=args.max_completion_length,
                              max_tool_calling_iterations=args.max_turns, model=policy,
                              accelerator=SimpleNamespace(unwrap_model=lambda model: model))
    prompts = [q for q in questions for _ in range(generations)]
    began = time.perf_counter()
    out = rollout(prompts, trainer)
    sync = rollout.stats.sync_seconds[-1]
    calls = statistics.mean(len(c) for c in out["tool_calls"])
    return dict(seconds=time.perf_counter() - began - sync, sync=sync, prefill=rollout.stats.prefill_tokens,
                rows=len(out["completion_ids"]), calls=calls, generated=rollout.stats.generated_tokens,
                tool_tokens=sum(len(m) - sum(m) for m in out["env_mask"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generations", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=256,
                        help="(TRL drops a tool result that would pass it and ends the row: a look-up's entry is up "
                             "to ~90 tokens, so 64 would cut most rows short on TRL's side only)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--continuous", action="store_true", help="also TRL on transformers' continuous batching")
    parser.add_argument("--onednn-peer", action="store_true",
                        help="also TRL's plain generate on a policy whose linears multiply on oneDNN's packed weights, "
                             "as ours do in float32 (not a TRL path: how much of the gap is the matmul library)")
    args = parser.parse_args()

    loaded = load_model(weights="float32")
    tokenizer = loaded.tokenizer
    tokenizer.chat_template = (ASSETS / "chat_template.jinja").read_text(encoding="utf-8")
    tokenizer.response_template = RESPONSE_TEMPLATE
    tools = default_tools()
    system = chat_messages(default_chat_template(), tools, lambda text: text)  # the chat protocol's own messages
    system = [{"content": "", **m} for m in system]  # (TRL reads every message's content; a call has none)
    questions = [q for q, _ in ARITHMETIC["wide"][: args.questions]]
    policy = plain_copy(loaded.model).train()  # (stock modules, in train mode as in a training step: TRL logs by it)
    packed_policy = None
    if args.onednn_peer:  # (its weights want no gradient, so its linears multiply on oneDNN: app.model.float32)
        packed_policy = copy.deepcopy(policy)
        to_packed(packed_policy)
    ours = {"ours, float32": EngineRollout(LocalBackend(loaded), protocol="chat", sync="float32", seed=0),
            "ours, int8": EngineRollout(LocalBackend(load_model(weights="int8")), protocol="chat", sync="int8", seed=0)}
    print(f"CPU: {cpu_name()}; {len(questions)} questions (tuning set), temperature {args.temperature}, "
          f"max_completion_length {args.max_completion_length}, max tool calls {args.max_turns}, chat protocol, "
          "guide off; TRL 1.16 GRPOTrainer(tools=...) without vLLM")
    print("seconds: the step's rollouts (ours: the system prompt prefilled again from the new weights, then every "
          "completion); sync: ours taking the policy's weights first (TRL samples from the policy itself); "
          "x TRL: seconds / TRL's, and (sync + seconds) / TRL's")
    header = f"{'G':>2} {'run':26} {'seconds':>8} {'sync':>6} {'prefilled':>10} {'model tokens':>12} " \
             f"{'tool tokens':>11} " \
             f"{'calls/row':>9} {'compl/s':>8} {'x TRL':>7} {'w/ sync':>7}"
    print(header)
    for generations in args.generations:
        rows = len(questions) * generations
        prompts = [system + [{"role": "user", "content": q}] for q in questions for _ in range(generations)]
        results = {}
        variants = [("TRL, generate", False, policy)] \
            + ([("TRL, continuous batching", True, policy)] if args.continuous else []) \
            + ([("TRL, generate, oneDNN linears", False, packed_policy)] if args.onednn_peer else [])
        for name, continuous, model in variants:
            attention = model.config._attn_implementation
            if continuous:  # (continuous batching refuses the app's own sdpa_gqa: transformers' sdpa there)
                model.set_attn_implementation("sdpa")
            trainer = trl_trainer(model, tokenizer, args, generations, rows, continuous)
            results[name] = run_trl(trainer, prompts)
            model.set_attn_implementation(attention)
        for name, rollout in ours.items():
            if rollout.stats.synced_step is None:
                run_ours(rollout, policy, questions[:1], 1, args)  # (warm-up: first passes, thread pools)
            results[name] = run_ours(rollout, policy, questions, generations, args)
        base = results["TRL, generate"]["seconds"]
        for name, r in results.items():
            sync = r.get("sync", 0.0)
            print(f"{generations:2d} {name:26} {r['seconds']:8.2f} {sync:6.2f} {r['prefill']:10d} "
                  f"{r['generated']:12d} {r['tool_tokens']:11d} {r['calls']:9.2f} {r['rows'] / r['seconds']:8.2f} "
                  f"{r['seconds'] / base:7.3f} {(r['seconds'] + sync) / base:7.3f}", flush=True)
    for rollout in ours.values():
        rollout.backend.scheduler.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
