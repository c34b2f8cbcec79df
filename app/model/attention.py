"""SDPA attention that reads grouped key/value heads in place for multi-token passes over a cache, where transformers'
`sdpa` copies each one per query head (`repeat_kv`). On CPU it hands the mask and grouped heads to PyTorch's kernel
(`enable_gqa`); every other case goes to the stock function."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"


def sdpa_gqa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if not (grouped and attention_mask is not None and query.shape[2] > 1 and query.device.type == "cpu"
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # same masks as `sdpa`


def use_gqa_sdpa(model) -> None:
    """Switch a model that runs stock `sdpa` to this function (others keep what they have)."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
