"""The rollout function for TRL's GRPOTrainer (app.training): episodes with their tool calls, logprobs and env_mask
as TRL's contract reads them, groups sharing their prefilled question, and the trainer itself for two steps with
the rollouts sampling from the weights its first step produced."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from app.backends.local import LocalBackend
from app.engine.engine import Engine
from app.engine.groups import open_group, run_groups
from app.episode import Episode
from app.model.float32 import plain_copy
from app.model.loading import wrap
from app.settings import Settings
from app.training.rewards import expected_tool_reward, exact_match_reward, well_formed_call_reward
from app.training.rollout import EngineRollout, runs
from tests.conftest import WritingModel

trl = pytest.importorskip("trl", reason="TRL is not installed (requirements-train.txt)")

PROMPT = "Answer with tools.\n{tools}\n\n"
CALL = "<request><Calculator>2 + 2<call>"


class RowWriter(WritingModel):
    """A WritingModel for sessions forked after their question (app.engine.groups): what it has written is counted
    per session (per KV cache object), from the session's first pass, not from the last prompt's prefill."""

    def forward(self, input_ids, **kwargs):
        past = kwargs.get("cache")
        if past is not getattr(self, "_past", None):
            self.ids, self._past = [], past
        return super().forward(input_ids, **kwargs)


def _fresh(tiny_llama: LocalBackend) -> LocalBackend:
    """A float32 backend on a copy of the tiny llama (its weights change here; the fixture's stay)."""
    return LocalBackend(wrap(copy.deepcopy(tiny_llama.model), tiny_llama.tokenizer, "tiny-llama-train"))


def test_consecutive_equal_prompts_are_one_group():
    assert runs(["a", "a", "b", "b", "a"]) == [("a", 2), ("b", 2), ("a", 1)]


def test_a_group_prefills_its_question_once_and_its_rows_differ(tiny_llama):
    backend = _fresh(tiny_llama)
    engine = Engine(backend, prompt=PROMPT)
    settings = Settings(max_new_tokens=8, max_turns=0, guide=False, temperature=1.0, logprobs=True).validated(4096)
    group = open_group(engine, "What is 2 + 2?", 3, settings, seed=5)
    [episodes] = run_groups(engine, [group])
    assert len(episodes) == 3
    assert all(e.token_ids[: e.query_end - e.query_start] == group.prompt_ids[e.query_start:] for e in episodes)
    assert [e.segments[0].prefill_tokens for e in episodes] == [1, 1, 1]  # (the question was prefilled before)
    assert len({tuple(e.token_ids) for e in episodes}) > 1  # (seeds 5, 6, 7)
    backend.scheduler.release()


def test_logprobs_are_the_sampling_distributions_own(tiny_llama):
    """Each model token's logprob equals log_softmax(logits / temperature) of a plain forward pass over the
    prompt and completion, as TRL recomputes it."""
    backend = _fresh(tiny_llama)
    engine = Engine(backend, prompt=PROMPT)
    settings = Settings(max_new_tokens=10, max_turns=0, guide=False, temperature=0.7, logprobs=True)
    group = open_group(engine, "What is 2 + 2?", 2, settings.validated(4096), seed=1)
    group.settings = settings.validated(4096)
    out = EngineRollout.result([e for g in run_groups(engine, [group]) for e in g], [group.prompt_ids] * 2)
    for prompt, completion, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        ids = torch.tensor([prompt + completion])
        with torch.inference_mode():
            logits = backend.model(ids).logits[0, len(prompt) - 1: -1] / 0.7
        want = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        assert len(logprobs) == len(completion)
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4)
    backend.scheduler.release()


def test_an_episode_that_kept_no_token_reaches_trl_as_one_masked_eos():
    """Regression: a training run crashed at step 6 in TRL's `_generate` (`ids[-1]`, IndexError) on a completion
    with no token: the model's first text was `<response>`, a cut stop the session drops."""
    empty = Episode("What does chain mean?", 10, 14, True, token_ids=[5, 6, 7, 8])
    kept = Episode("What is 2 + 2?", 10, 12, True, token_ids=[5, 6, 9])
    out = EngineRollout.result([empty, kept], [[1, 5, 6, 7, 8], [1, 5, 6]], eos=2)
    assert out["completion_ids"] == [[2], [9]]
    assert out["env_mask"][0] == [0] and out["logprobs"][0] == [0.0]
    assert out["stop_reason"][0] == "none"


@pytest.mark.parametrize("protocol, refused", [("textenv", True), ("chat", False)])
def test_mask_truncated_completions_is_refused_where_answers_do_not_end_at_eos(tiny_llama, protocol, refused):
    """TRL masks every completion whose last token is not EOS; textenv's answers end at `<submit>`, so with
    mask_truncated_completions no row would teach anything: a clear error instead."""
    from types import SimpleNamespace

    rollout = EngineRollout(tiny_llama, protocol=protocol, sync=None)
    trainer = SimpleNamespace(args=SimpleNamespace(mask_truncated_completions=True))
    if refused:
        with pytest.raises(ValueError, match="mask_truncated_completions"):
            rollout.check_trainer(trainer)
    else:
        rollout.check_trainer(trainer)
    rollout.check_trainer(SimpleNamespace(args=SimpleNamespace(mask_truncated_completions=False)))


def test_rewards_read_the_rollouts_fields():
    assert exact_match_reward([], answer=["Result = 4", "5", "x"], expected=["4", "4", None]) == [1.0, 0.0, None]
    assert well_formed_call_reward([], tool_calls=[[["Calculator", "2+2"]], [], [["S", "x"]]],
                                   tool_ok=[[True], [], [False]]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("calls, ok, tool, reward", [
    ([["Search", "kludge"]], [True], "Search", 1.0),
    ([["search", "kludge"]], [True], "Search", 1.0),  # (the chat protocol's spelling)
    ([["Calculator", "kludge"]], [False], "Search", 0.0),  # the wrong tool: the regression of the sums-only run
    ([["Search", "x"], ["Calculator", "2+2"]], [True, True], "Search", 0.0),
    ([["Search", "kludge"]], [False], "Search", 0.0),
    ([], [], "Search", 0.0),
    ([["Search", "kludge"]], [True], None, None),  # no expected tool: no reward
])
def test_expected_tool_reward(calls, ok, tool, reward):
    assert expected_tool_reward([], tool_calls=[calls], tool_ok=[ok], tool=[tool]) == [reward]


def test_grpo_trainer_runs_two_steps_on_the_rollouts(tiny_llama, tmp_path):
    """GRPOTrainer with the rollout function: every completion calls the calculator (the model writes the call,
    then samples freely); env_mask is 0 exactly on the tool's output; the loss is finite; the second step's
    rollouts sample from the weights the first step produced."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    backend = _fresh(tiny_llama)
    writer = RowWriter(backend.model, backend.tokenizer, (CALL, ""))  # (after the tool's output: the model's own)
    engine_backend = LocalBackend(dataclasses.replace(backend.loaded, model=writer))
    rollout = EngineRollout(engine_backend, prompt=PROMPT, sync="float32")
    seen = []

    def rollout_func(prompts, trainer):
        out = rollout(prompts, trainer)
        engine_state = rollout.backend.model.state_dict()
        policy = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        same = all(torch.equal(engine_state[k], policy[k]) for k in policy)
        seen.append(dict(prompts=list(prompts), out=out, same=same, step=trainer.state.global_step,
                         episodes=rollout.stats.rows, state={k: v.clone() for k, v in engine_state.items()}))
        return out

    def token_sum(completion_ids, **_):  # (a reward that varies between the free completions)
        return [sum(ids) % 7 / 7 for ids in completion_ids]

    policy = plain_copy(tiny_llama.model).train().requires_grad_(True)
    data = Dataset.from_dict({"prompt": ["What is 2 + 2?", "What is 3 + 5?"], "expected": ["4", "8"]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=2,
                      max_completion_length=40, learning_rate=0.05, beta=0.0, temperature=1.0, logging_steps=1,
                      report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
                      max_tool_calling_iterations=2)
    trainer = GRPOTrainer(model=policy, reward_funcs=[exact_match_reward, well_formed_call_reward, token_sum],
                          args=args, train_dataset=data, processing_class=tiny_llama.tokenizer,
                          rollout_func=rollout_func)
    trainer.train()

    assert [s["step"] for s in seen] == [0, 1]
    assert all(s["same"] for s in seen)  # the engine sampled from the trainer's weights of that step
    assert any(not torch.equal(seen[0]["state"][k], seen[1]["state"][k]) for k in seen[0]["state"])  # which moved
    for s in seen:
        prompts, out = s["prompts"], s["out"]
        assert len(prompts) == 4 and prompts[0] == prompts[1]  # (TRL repeats each prompt num_generations times)
        assert len(out["completion_ids"]) == 4
        assert all(calls and calls[0][0] == "Calculator" for calls in out["tool_calls"])
        for ids, mask, logprobs, prompt_ids in zip(out["completion_ids"], out["env_mask"], out["logprobs"],
                                                   out["prompt_ids"]):
            assert len(mask) == len(ids) == len(logprobs)
            text = tiny_llama.tokenizer.decode(ids)
            call_end = text.index("<call>") + len("<call>")
            response_end = text.index("<response>", call_end) + len("<response>")
            inserted = [i for i, m in enumerate(mask) if m == 0]
            assert inserted == list(range(inserted[0], inserted[-1] + 1))  # one run: the tool segment
            before = tiny_llama.tokenizer.decode(ids[: inserted[0]])
            tool_text = tiny_llama.tokenizer.decode(ids[inserted[0]: inserted[-1] + 1])
            assert before == text[:call_end] and tool_text == text[call_end:response_end]
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in logprobs)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    rollout.backend.scheduler.release()


def test_the_trainers_sampling_settings_reach_every_group(tiny_llama):
    from types import SimpleNamespace

    rollout = EngineRollout(tiny_llama, tools={}, prompt=PROMPT, sync=None)
    trainer = SimpleNamespace(temperature=0.9, top_p=0.8, top_k=20, max_completion_length=30,
                              max_tool_calling_iterations=3)
    settings = rollout.settings(trainer, prompt_tokens=50)
    assert (settings.temperature, settings.top_p, settings.top_k, settings.max_turns) == (0.9, 0.8, 20, 3)
    assert settings.max_length == 80 and settings.logprobs and not settings.guide
