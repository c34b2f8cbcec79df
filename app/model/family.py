"""The decoder families the fast path covers (Llama, Qwen2, Qwen3) and what sets them apart, as data: `LayerShape` reads
the few differences from the config (q/k/v biases, Qwen3's head norms and head_dim, a tied head, rotary base, epsilon),
so no pass tests a family by name. A model `fast_path_reason` refuses runs on its own forward, one row a step."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("llama", "qwen2", "qwen3")  # model_type values whose layers LayerShape describes


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer of a covered family, as the fast path computes it."""

    family: str
    hidden: int
    intermediate: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    qkv_bias: bool  # biases on the q/k/v projections (packed with their weights: one fused matmul)
    head_norms: bool  # per-head RMS norms of queries and keys before the rotary embeddings (Qwen3)
    tied_head: bool  # the LM head shares the embedding table (int8 keeps the table float32 and quantizes a copy)
    rope_theta: float
    eps: float  # every RMS norm's epsilon


def layer_shape(config) -> LayerShape:
    """The layer description of a covered family's config (see fast_path_reason for which are)."""
    heads = config.num_attention_heads
    family = config.model_type
    rope = getattr(config, "rope_parameters", None) or {}
    return LayerShape(
        family=family, hidden=config.hidden_size, intermediate=config.intermediate_size, heads=heads,
        groups=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
        head_norms=family == "qwen3",
        tied_head=bool(getattr(config, "tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)) or 10000.0),
        eps=float(config.rms_norm_eps))


def fast_path_reason(config) -> str | None:
    """Why a model of this config does not take the fast path, in one line for the log and the stats panel; None where
    it does."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model type {family!r} is not one the fast path covers ({', '.join(FAMILIES)})"
    if getattr(config, "sliding_window", None) and any(
            kind == "sliding_attention" for kind in (getattr(config, "layer_types", None) or ["sliding_attention"])):
        return "sliding-window attention (the fast path attends to every cached position)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"MLP activation {config.hidden_act!r} (the fast path computes SiLU)"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "rotary embeddings on part of each head (the fast path rotates whole heads)"
    return None


def describe(config) -> str:
    """Which path a model runs and why, for the stats panel: "batched pass (qwen2: q/k/v biases, untied head)"."""
    reason = fast_path_reason(config)
    if reason is not None:
        return f"the model's own forward, one row a step: {reason}"
    shape = layer_shape(config)
    facts = [f"{shape.groups}/{shape.heads} kv/query heads of {shape.head_dim}"]
    if shape.qkv_bias:
        facts.append("q/k/v biases")
    if shape.head_norms:
        facts.append("q/k head norms")
    facts.append("tied head" if shape.tied_head else "untied head")
    return f"batched pass ({shape.family}: {', '.join(facts)})"
