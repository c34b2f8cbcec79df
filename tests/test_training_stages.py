"""The pieces of scripts/train.py's two stages: generated questions kept apart from held-out ones, supervised
examples that learn only the model's and the guide's tokens, the shared-prefix SFT loss equal to the whole
sequence's, the task rewards, and a peft policy's weights reaching the engine with its adapter merged."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.nn.functional as F

from app.engine.engine import Engine
from app.episode import Episode, Provenance, Segment
from app.settings import Settings
from app.tools.registry import default_tools
from app.training import questions as gen
from app.training.rewards import right_answer, right_answer_reward, right_tool
from app.training.sft import IGNORE, SharedPrefixSFT, batches, example
from app.training.teacher import replied, teacher_tools
from tests.conftest import writing

peft = pytest.importorskip("peft")


def test_generated_sums_carry_the_calculators_value():
    rng = random.Random(3)
    calculator = default_tools()["Calculator"]
    for question in gen.plain_sums(rng, 20):
        expression = re.search(r"[\d,]+ [-+*/] [\d,]+", question.text).group()
        assert calculator.function(expression) == question.expected, question
    hard = gen.hard_sums(rng, 60)
    assert {q.kind for q in hard} == {"hard"} and all(q.expected for q in hard)
    assert any(q.expected.startswith("-") for q in hard)  # (negative results are in the mix)


def test_every_generated_call_gives_the_expected_answer_and_the_teacher_claims_exactly_those():
    rng = random.Random(4)
    questions = (gen.plain_sums(rng, 10) + gen.hard_sums(rng, 30) + gen.lookups(rng, 5) + gen.chitchat(rng, 3))
    tools = default_tools()
    for q in questions:
        if q.kind in ("sum", "hard"):
            assert q.call[0] == "Calculator" and tools["Calculator"].function(q.call[1]) == q.expected, q
    assert all(q.call == ("Search", q.expected) for q in questions if q.kind == "look-up")
    taught = teacher_tools(tools, questions)
    for q in questions:
        claimed = [(name, tool.claims(q.text)) for name, tool in taught.items() if tool.claims(q.text)]
        assert claimed == ([q.call] if q.call else []), q
    assert taught["Calculator"].claims("What is 2 + 2?") is None  # (only the generated questions: no guessing)
    with pytest.raises(ValueError, match="Weather"):
        teacher_tools(tools, [gen.Question("Is it raining?", "sum", "no", ("Weather", "here"))])


def test_lookups_avoid_held_out_words_and_disjoint_refuses_a_held_out_question():
    words = {q.expected for q in gen.lookups(random.Random(0), 200, avoid=["What does kludge mean?"])}
    assert "kludge" not in words and len(words) == 200
    with pytest.raises(ValueError, match="held-out"):
        gen.disjoint([gen.Question("What is 57 * 38?", "sum", "2166")], ["what is 57  * 38?"])


def _episode() -> Episode:
    """A question of 2 tokens, a call the guide forced (3), a tool's output (2), an answer: 1 steered, 2 the model's."""
    call = Segment("model", "c", 2, 5, provenance=[Provenance.FORCED] * 3)
    tool = Segment("tool", "t", 5, 7, tool="Calculator", query="2 + 2")
    answer = Segment("model", "a", 7, 10, provenance=[Provenance.STEERED, Provenance.MODEL, Provenance.MODEL])
    return Episode("q", 0, 2, True, segments=[call, tool, answer], token_ids=[11, 12, 21, 22, 23, 31, 32, 41, 42, 2])


def test_an_example_learns_the_model_and_guide_tokens_only():
    ex = example(_episode())
    assert ex.ids == [11, 12, 21, 22, 23, 31, 32, 41, 42, 2]
    assert ex.labels == [IGNORE, IGNORE, 21, 22, 23, IGNORE, IGNORE, 41, 42, 2]


def test_batches_cycle_through_every_example():
    seen = [e for batch, _ in zip(batches(list(range(5)), 2, seed=1), range(5)) for e in batch]
    assert sorted(seen[:5]) == [0, 1, 2, 3, 4] and len(seen) == 10


@pytest.mark.parametrize("prompt, given", [([1, 7, 8, 9, 10], None), ([1, 5, 6], [1, 5, 6])])
def test_the_shared_prefix_loss_is_the_whole_sequences(tiny_llama, prompt, given):
    """The prompt's keys/values computed once without gradient give the loss a full forward pass gives; a batch
    may name another prompt (the other protocol's) than the one the trainer started with."""
    from app.model.float32 import plain_copy

    model = plain_copy(tiny_llama.model).eval().requires_grad_(True)
    batch = [example(_episode()), gen_example([3, 4, 5, 6], [IGNORE, 4, 5, 6])]
    sft = SharedPrefixSFT(model, [1, 7, 8, 9, 10], 1e-3, pad_id=2)
    with torch.no_grad():
        shared = sft.loss(batch, given)
        losses, counts = [], []
        for ex in batch:
            logits = model(input_ids=torch.tensor([prompt + ex.ids])).logits[0, len(prompt):]
            labels = torch.tensor(ex.labels)
            losses.append(F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum"))
            counts.append(int((labels[1:] != IGNORE).sum()))
    assert float(shared) == pytest.approx(float(sum(losses)) / sum(counts), rel=1e-4)


def gen_example(ids: list[int], labels: list[int]):
    from app.training.sft import Example

    return Example(ids, labels)


def test_sft_steps_lower_the_loss_of_a_lora_policy(tiny_llama):
    from app.model.float32 import plain_copy

    torch.manual_seed(0)
    policy = peft.get_peft_model(plain_copy(tiny_llama.model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0))
    batch = [example(_episode())]
    sft = SharedPrefixSFT(policy, [1, 7, 8], 5e-2, pad_id=2)
    first = sft.step(batch)
    for _ in range(20):
        last = sft.step(batch)
    assert last < first - 0.3  # (a 32-wide random model: the adapter cannot move its head far)


@pytest.mark.parametrize("kind, expected, answer, calls, answered, is_right, tool", [
    ("sum", "42", "Result = 42", [("calculator", "6 * 7")], True, True, True),
    ("sum", "42", "Result = 42", [("search", "6 * 7")], True, True, False),  # (right answer, wrong tool)
    ("hard", "-3", "Result = 3", [("calculator", "5 - 8")], True, False, True),
    ("sum", "42", "Result = 42", [("calculator", "6 * 7")], False, False, True),  # (never ended its answer)
    ("look-up", "grok", "Result = grok: to understand deeply", [("search", "grok")], True, True, True),
    ("look-up", "grok", "Result = grok: to understand deeply", [("search", "grok it")], True, False, True),
    ("look-up", "grok", "grok", [("search", "grok")], True, False, True),  # (no definition copied)
    ("chit-chat", None, "Hello!", [], True, True, True),
    ("chit-chat", None, "Result = 4", [("calculator", "2 + 2")], True, False, False),
])
def test_task_verdicts(kind, expected, answer, calls, answered, is_right, tool):
    assert right_answer(kind, expected, answer, calls, answered) is is_right
    assert right_tool(kind, calls) is tool
    assert right_answer_reward([None], [kind], [expected], [answer], [calls], [answered]) == [float(is_right)]


def test_a_peft_policys_weights_reach_the_engine_merged(tiny_llama):
    from app.model.float32 import plain_copy
    from app.training.weights import trainer_weights

    base = plain_copy(tiny_llama.model)
    names = set(base.state_dict())
    policy = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                       lora_dropout=0.0))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    state = trainer_weights(policy)
    assert set(state) == names
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(state[q], expected, atol=1e-6)
    assert not torch.allclose(layer.base_layer.weight, expected)  # (the policy's own layer is unmerged again)


REPLY = "Hello! What would you like me to calculate or look up?"


@pytest.mark.parametrize("protocol, marker, wrote, taught", [
    ("chat", "<|im_start|>tool", "You're welcome!<|im_end|>", REPLY + "<|im_end|>"),
    ("textenv", "<response>", "Result = You're welcome!<submit>", f"Result = {REPLY}<submit>"),  # (`=` forced)
])
def test_a_chit_chat_example_is_the_teachers_episode_with_the_written_reply(tiny_llama, protocol, marker, wrote,
                                                                            taught):
    """Regression: the base model's guided greetings said "You're welcome!" to "Who are you?", and stage 1 taught it.
    The question and the episode's own ending stay; the model's words are the written reply."""
    tokenizer = tiny_llama.tokenizer
    engine = Engine(writing(tiny_llama, wrote, marker=marker, specials=True), protocol=protocol)
    [episode] = engine.run(["Hello!"], Settings(max_new_tokens=24), guide=True)
    assert episode.answered and episode.answer.endswith("You're welcome!")
    question = episode.provenance.count("user")
    ex = replied(episode, REPLY, tokenizer)
    assert ex.ids[:question] == episode.token_ids[:question] and ex.labels[:question] == [IGNORE] * question
    assert tokenizer.decode(ex.ids[question:]) == taught and ex.labels[question:] == ex.ids[question:]
    assert ex.ids[-1] == episode.token_ids[-1]  # (the ending the model wrote: EOS, `>` of <submit>)


def test_a_chit_chat_episode_that_called_a_tool_or_never_ended_teaches_nothing(tiny_llama):
    engine = Engine(writing(tiny_llama, "<request><Calculator>2 + 2<call>", "Result = 4<submit>"),
                    prompt="You answer questions.", protocol="textenv")  # (no examples: the writer counts results)
    called, = engine.run(["Hello!"], Settings(max_new_tokens=24, max_turns=1), guide=False)
    cut, = Engine(writing(tiny_llama, "Result = Hello there, how nice to see you today<submit>"),
                  protocol="textenv").run(["Hello!"], Settings(max_new_tokens=4), guide=False)
    assert called.segments[1].kind == "tool" and not cut.answered
    assert replied(called, REPLY, tiny_llama.tokenizer) is None and replied(cut, REPLY, tiny_llama.tokenizer) is None


def test_every_training_chit_chat_has_a_written_reply_naming_the_tools():
    questions = gen.chitchat(random.Random(0), len(gen.CHITCHAT))
    assert {q.text for q in questions} == set(gen.CHITCHAT) and all(q.reply and "{" not in q.reply for q in questions)
    assert any("a calculator and the Jargon File" in q.reply for q in questions)
    assert not any("welcome" in q.reply.lower() for q in questions if "thank" not in q.text.lower())


def test_word_problems_are_hard_sums_with_their_call():
    for q in gen.word_problems(random.Random(2), 30):
        assert q.kind == "hard" and default_tools()["Calculator"].function(q.call[1]) == q.expected
        assert not any(c in q.text for c in "+*/")
