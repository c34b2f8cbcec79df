"""Rows with few new tokens attending in one C call a layer (app.kernels.attend_rows) against PyTorch's SDPA, which every
longer row still takes: outputs, the keys/values written into each row's cache, and bits that depend on the row
alone (not on the rows beside it, nor on the threads)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig

from app.kernels import native
from app.kernels.attend_rows import BATCH_TOKENS, Batch, available, batched
from app.model.kvcache import new_kv
from app.model.ragged import causal_mask
from tests.native_support import AVX512, c_library, needs


@pytest.fixture(autouse=True)
def _built():
    c_library()  # a failed C build fails these tests, with the compiler's message


@dataclass
class Case:
    n: int  # new tokens
    past: int  # positions its own cache holds
    shared: int  # positions of its shared prefix (0: none)


@dataclass
class FakeRow:
    kv: DynamicCache
    prefix: DynamicCache | None


def _config(heads: int, groups: int, dim: int) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=groups,
                       hidden_size=heads * dim, head_dim=dim)


def _filled(config, length: int, gen: torch.Generator) -> DynamicCache | None:
    if not length:
        return None
    kv = new_kv(config)
    groups, dim = config.num_key_value_heads, config.head_dim
    kv.layers[0].update(torch.randn(1, groups, length, dim, generator=gen), torch.randn(1, groups, length, dim,
                                                                                        generator=gen))
    return kv


def _pass(cases: list[Case], heads: int, groups: int, dim: int, seed: int, share: bool = False):
    """The rows of `cases` with their caches, and one pass's q/k/v laid out as the fused layer has them (views
    of one [tokens, width] tensor: strides between heads of dim, between tokens of width). `share`: rows with
    prefixes of one length share one prefix (as sessions share their system prompt's)."""
    gen = torch.Generator().manual_seed(seed)
    config = _config(heads, groups, dim)
    rows, prefixes = [], {}
    for case in cases:
        own = _filled(config, case.past, gen) or new_kv(config)
        if not share or case.shared not in prefixes:
            prefixes[case.shared] = _filled(config, case.shared, gen)
        rows.append(FakeRow(own, prefixes[case.shared]))
    tokens = sum(case.n for case in cases)
    y = torch.randn(tokens, (heads + 2 * groups) * dim, generator=gen)
    q, k, v = (p.view(1, tokens, -1, dim).transpose(1, 2) for p in y.split([heads * dim, groups * dim,
                                                                            groups * dim], dim=-1))
    spans, at = [], 0
    for case in cases:
        spans.append((at, at + case.n))
        at += case.n
    return rows, spans, q, k, v


def _reference(row: FakeRow, case: Case, q, k, v, span, scale: float) -> torch.Tensor:
    """SDPA over the prefix, the cache before the pass and the new keys, causal for the new queries: [n, heads,
    dim]."""
    a, b = span
    layers = [row.prefix.layers[0]] if row.prefix is not None else []
    held = [(layer.keys, layer.values) for layer in layers]
    if case.past:  # (before the pass: the cache grows by the new keys in it)
        held.append((row.kv.layers[0].keys[:, :, :case.past], row.kv.layers[0].values[:, :, :case.past]))
    keys = torch.cat([part[0] for part in held] + [k[:, :, a:b]], dim=2)
    values = torch.cat([part[1] for part in held] + [v[:, :, a:b]], dim=2)
    mask = causal_mask(case.n, keys.shape[2] - case.n, None)
    return F.scaled_dot_product_attention(q[:, :, a:b], keys, values, attn_mask=mask, scale=scale, enable_gqa=True,
                                          is_causal=mask is None and case.n > 1)[0].transpose(0, 1)


CASES = [
    [Case(1, 0, 0)],  # a new session's first token, no prefix
    [Case(1, 100, 0), Case(3, 40, 800), Case(1, 0, 30), Case(16, 5, 0), Case(2, 3, 10)],  # (a prefix in 1 piece)
    [Case(8, 1500, 0), Case(2, 17, 900)],
    [Case(37, 60, 800), Case(1, 5, 800), Case(BATCH_TOKENS, 0, 0)],  # tool results: rows split into several tasks
]


needs_fast = needs(AVX512)  # attend_rows.c's fast path is AVX-512 code (test_which_models_attend_here: it is built)

DIMS = [64, 128]  # the heads the fast path takes (the bundled model's; Qwen3's)


@needs_fast
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("cases", CASES)
@pytest.mark.parametrize("heads,groups", [(9, 3), (8, 2), (4, 4), (8, 1), (16, 8)])
@pytest.mark.parametrize("dim", DIMS)
def test_rows_match_sdpa_and_their_caches_get_the_new_keys(cases, heads, groups, share, dim):
    rows, spans, q, k, v = _pass(cases, heads, groups, dim, seed=len(cases) + heads, share=share)
    want = [_reference(row, case, q, k, v, span, 0.125) for row, case, span in zip(rows, cases, spans)]
    out = torch.full((q.shape[2], heads, dim), float("nan"))
    Batch(rows, spans, k).attend(q, k, v, 0, 0.125, out)
    for row, case, (a, b), expected in zip(rows, cases, spans, want):
        assert torch.allclose(out[a:b], expected, atol=2e-6, rtol=1e-5)
        layer = row.kv.layers[0]
        assert layer.keys.shape[2] == case.past + case.n
        assert torch.equal(layer.keys[:, :, case.past:], k[:, :, a:b]) and torch.equal(layer.values[:, :, case.past:],
                                                                                      v[:, :, a:b])


@needs_fast
@pytest.mark.parametrize("heads,groups", [(9, 3), (16, 8)])
@pytest.mark.parametrize("dim", DIMS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(dim, heads, groups):
    cases = [Case(1, 100, 800), Case(3, 40, 800), Case(2, 700, 0)]

    def alone_and_together(threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # (the C call runs on the calling thread's OpenMP team: torch's)
        try:
            rows, spans, q, k, v = _pass(cases, heads, groups, dim, seed=4)
            together = torch.empty(q.shape[2], heads, dim)
            Batch(rows, spans, k).attend(q, k, v, 0, 0.125, together)
            rows, spans, q, k, v = _pass(cases, heads, groups, dim, seed=4)
            alone = torch.empty(q.shape[2], heads, dim)
            Batch(rows[1:2], spans[1:2], k).attend(q, k, v, 0, 0.125, alone)
            a, b = spans[1]
            return together[a:b], alone[a:b]
        finally:
            torch.set_num_threads(before)

    together, alone = alone_and_together(2)
    assert torch.equal(together, alone)
    assert torch.equal(alone_and_together(1)[0], together)


@needs_fast
@pytest.mark.parametrize("heads,groups", [(9, 3), (8, 1), (16, 8)])
@pytest.mark.parametrize("dim", DIMS)
def test_rows_sharing_a_prefix_get_the_bits_they_get_alone(heads, groups, dim):
    """Rows sharing a prefix have their queries over it computed 16 to a task whatever their rows, one lane each:
    a row's tokens fall in other lanes and tasks beside other rows (here 3 to 6 tasks a key/value head) than alone,
    and still get the same bits."""
    cases = [Case(1, 30, 300), Case(5, 0, 300), Case(2, 90, 300), Case(7, 12, 300), Case(3, 4, 0)]
    rows, spans, q, k, v = _pass(cases, heads, groups, dim, seed=5, share=True)
    together = torch.empty(q.shape[2], heads, dim)
    Batch(rows, spans, k).attend(q, k, v, 0, 0.125, together)
    for i, (a, b) in enumerate(spans):
        rows, spans, q, k, v = _pass(cases, heads, groups, dim, seed=5, share=True)
        alone = torch.empty(q.shape[2], heads, dim)
        Batch(rows[i:i + 1], spans[i:i + 1], k).attend(q, k, v, 0, 0.125, alone)
        assert torch.equal(alone[a:b], together[a:b]), f"row {i}"


@needs_fast
def test_which_models_attend_here():
    """The C path covers 64- and 128-value heads with up to 8 query heads a key/value head (the bundled model: 64,
    3; Qwen3-0.6B: 128, 2); other models keep PyTorch's kernels for every row."""
    assert available(_config(9, 3, 64)) and available(_config(8, 8, 64)) and available(_config(16, 8, 128))
    assert not available(_config(4, 2, 16)) and not available(_config(16, 1, 64))
    assert not available(_config(8, 8, 96)) and not available(_config(16, 1, 128))


def test_which_rows_attend_here():
    config = _config(9, 3, 64)
    own, prefix = new_kv(config), _filled(config, 10, torch.Generator().manual_seed(0))
    assert batched(1, own, None) and batched(BATCH_TOKENS, own, prefix)
    assert not batched(BATCH_TOKENS + 1, own, prefix)  # a prefill chunk: PyTorch's kernel
    assert not batched(1, DynamicCache(config=config), None)  # a cache without room to write in place
    assert not batched(1, own, new_kv(config))  # an empty prefix


def test_without_the_library_pytorch_runs(monkeypatch):
    monkeypatch.setenv("TEXTENV_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert not available(_config(9, 3, 64))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_fast
@pytest.mark.parametrize("n", [4, 11])
@pytest.mark.parametrize("past", [30, 250])  # 250: the draft's tokens straddle a piece of own positions (256)
@pytest.mark.parametrize("dim", DIMS)
def test_a_token_gets_the_same_bits_in_a_draft_as_alone(n, past, dim):
    """Each query's scores, softmax and sums run in one order whatever its row's token count or the task and lane
    its token falls in (a row's tokens go 16 // query heads a key/value head to a task), so a drafted token's attention is the same bits as when it is fed
    alone after the tokens before it."""
    config = _config(9, 3, dim)
    rows, spans, q, k, v = _pass([Case(n, past, 200)], 9, 3, dim, seed=9)
    (row,) = rows
    alone_row = FakeRow(new_kv(config), row.prefix)
    layer = row.kv.layers[0]
    alone_row.kv.layers[0].update(layer.keys.clone(), layer.values.clone())
    together = torch.empty(n, 9, dim)
    Batch(rows, spans, k).attend(q, k, v, 0, 0.125, together)
    for t in range(n):
        one = torch.empty(1, 9, dim)
        q1, k1, v1 = (x[:, :, t:t + 1] for x in (q, k, v))
        Batch([alone_row], [(0, 1)], k1).attend(q1, k1, v1, 0, 0.125, one)
        assert torch.equal(one[0], together[t])
