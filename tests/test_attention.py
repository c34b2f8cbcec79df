"""The grouped-head SDPA path: same logits as transformers' stock `sdpa`, chosen for the models we load."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from app.model.attention import NAME


def _pass_over_cache(model, history: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Logits of a multi-token pass over a cached history: the masked case the grouped path handles."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=history, cache=cache, use_cache=True)
        return model(input_ids=new, cache=cache, use_cache=True).logits


def test_loaded_models_use_the_grouped_path(real, tiny_llama):
    assert real.model.config._attn_implementation == NAME
    assert tiny_llama.model.config._attn_implementation == NAME


@pytest.mark.parametrize("new_tokens", [1, 2, 16])
def test_grouped_path_gives_the_stock_sdpa_logits(tiny_llama, new_tokens):
    stock = copy.deepcopy(tiny_llama.model)
    stock.set_attn_implementation("sdpa")
    history = torch.randint(3, 1000, (1, 300))
    new = torch.randint(3, 1000, (1, new_tokens))
    ours = _pass_over_cache(tiny_llama.model, history, new)
    theirs = _pass_over_cache(stock, history, new)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_grouped_path_reads_key_value_heads_without_copying_them(tiny_llama, monkeypatch):
    """Regression: stock `sdpa` repeats each key/value head per query head whenever a mask is given, a copy that
    grows with the history on every new chat turn and tool result."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append((query.shape[1], key.shape[1], kwargs.get("attn_mask") is not None, kwargs.get("enable_gqa")))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _pass_over_cache(tiny_llama.model, torch.randint(3, 1000, (1, 40)), torch.randint(3, 1000, (1, 5)))
    masked = [s for s in seen if s[2]]
    assert masked and all(heads == 4 and kv_heads == 2 and gqa for heads, kv_heads, _, gqa in masked)
