"""One forward pass over several sessions' new tokens at once, each attending only to its own KV cache. The rows are
ragged, as in vLLM: laid end to end for the layers that hold weights, split only for attention, with no padding or masks
between rows. A row reading a shared prefix merges its attention over the prefix and over its own keys by log-sum-exp
(cascade attention); short rows do all this in one C call a layer (app.kernels.attend_rows), and int8 layers run in C
(app.kernels.int8_layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from app.kernels import attend_rows
from app.kernels.int8_layer import fused_layers
from app.model.family import FAMILIES, LayerShape, fast_path_reason, layer_shape

SUPPORTED = frozenset(FAMILIES)
# PyTorch's CPU flash attention rounds a block of fewer than 4 queries differently, and its blocks grow from 192
# queries a call: shared-prefix calls are padded to a multiple of 4 and kept under 192 so a query's bits never
# depend on who shares the call.
QUERY_PAD = 4
QUERIES_PER_CALL = 160


@dataclass
class Row:
    """One session's part of a pass: `ids` are fed at positions start.. and appended to `kv`."""

    kv: DynamicCache
    ids: list[int]
    start: int  # tokens `kv` holds already (= the first new token's position)
    keep: int  # logits wanted for the last `keep` new tokens
    prefix: DynamicCache | None = None  # a shared, read-only cache of the positions before `kv`'s


def supports(model) -> bool:
    """Whether `ragged_forward` computes this model exactly like its own forward."""
    return fast_path_reason(model.config) is None and hasattr(model, "model") and hasattr(model, "lm_head")


def shape_of(model) -> LayerShape:
    """The model's layer description, read from its config once (kept on the model, like int8_layer's C views)."""
    made = model.__dict__.get("_layer_shape")
    if made is None:
        made = model.__dict__["_layer_shape"] = layer_shape(model.config)
    return made


def causal_mask(n: int, past: int, repeat: int | None) -> torch.Tensor | None:
    """Which of its past + n keys each of a row's n new queries may see: the same in every layer, so built once
    per pass. For _attend (repeat None): a boolean mask, or None where SDPA needs none (one query, or no past:
    plain causal). For _attend_lse: additive, each query's row repeated for the `repeat` heads that share a
    key/value head; None for one query."""
    if n == 1:
        return None
    allowed = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
    if repeat is None:
        return allowed if past else None
    return torch.zeros(n * repeat, past + n).masked_fill_(~allowed.repeat(repeat, 1), float("-inf"))


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """A row's causal attention: its n new queries over its past + n keys (grouped heads read in place)."""
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True,
                                          is_causal=mask is None and query.shape[2] > 1)


def _attend_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Like _attend, with each query's log-sum-exp of scores. The query heads that share a key/value head are
    laid end to end as one longer sequence of queries, so grouped keys are read in place here too."""
    _, heads, n, dim = query.shape
    groups = keys.shape[1]
    grouped = query.reshape(1, groups, heads // groups * n, dim)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(grouped, keys, values, 0.0, False,
                                                                         attn_mask=mask, scale=scale)
    return out.reshape(query.shape), lse.reshape(1, heads, n)


def _attend_blocks(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of [1, groups, m, dim] queries (any number, from any rows) over grouped keys, with
    each query's log-sum-exp: the same bits for a query whichever queries share its call (see QUERY_PAD)."""
    m = queries.shape[2]
    if m % QUERY_PAD:
        queries = F.pad(queries, (0, 0, 0, QUERY_PAD - m % QUERY_PAD))
    outs, lses = [], []
    for at in range(0, queries.shape[2], QUERIES_PER_CALL):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries[:, :, at:at + QUERIES_PER_CALL], keys, values, 0.0, False, scale=scale)[:2]
        outs.append(out)
        lses.append(lse)
    out, lse = (torch.cat(outs, dim=2), torch.cat(lses, dim=2)) if len(outs) > 1 else (outs[0], lses[0])
    return out[:, :, :m], lse[:, :, :m]


def _prefix_readers(rows: list[Row], skip: set[int]) -> list[list[int]]:
    """The rows that read each shared prefix (row numbers, one list per prefix; rows in `skip` read theirs in
    attend_rows.Batch): the same in every layer."""
    readers: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if row.prefix is not None and i not in skip:
            readers.setdefault(id(row.prefix), []).append(i)
    return list(readers.values())


def _prefix_attention(query: torch.Tensor, rows: list[Row], spans: list[tuple[int, int]], readers: list[list[int]],
                      index: int, scale: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every row's attention over its shared prefix in layer `index` (row number -> output, log-sum-exp), one call per
    prefix for all the rows that read it."""
    _, heads, _, dim = query.shape
    parts = {}
    for members in readers:
        layer = rows[members[0]].prefix.layers[index]
        groups = layer.keys.shape[1]
        every = len(members) == len(rows)
        tokens = query if every else torch.cat([query[:, :, slice(*spans[i])] for i in members], dim=2)
        n = tokens.shape[2]
        out, lse = _attend_blocks(tokens.reshape(1, groups, heads // groups * n, dim), layer.keys, layer.values, scale)
        out, lse = out.reshape(1, heads, n, dim), lse.reshape(1, heads, n)
        at = 0  # the members' tokens lie end to end in `tokens`
        for i in members:
            b = at + spans[i][1] - spans[i][0]
            # contiguous, as a row alone gets them, so the merge takes the same kernels
            parts[i] = out[:, :, at:b].contiguous(), lse[:, :, at:b].contiguous()
            at = b
    return parts


def _merge(head: torch.Tensor, head_lse: torch.Tensor, own: torch.Tensor, own_lse: torch.Tensor) -> torch.Tensor:
    """Two attention outputs over disjoint keys as one softmax over both: the prefix's share is sigmoid(h - o)."""
    return torch.lerp(own, head, torch.sigmoid(head_lse - own_lse).unsqueeze(-1))


class TorchLayers:
    """A layer besides attention as the model's own modules compute it (any weights);
    app.kernels.int8_layer.FusedInt8Layers does the same for int8 in C."""

    @staticmethod
    def attention_inputs(layer, shape: LayerShape, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries and keys (each head normed where `shape.head_norms`, then rotated) and values, each
        [1, heads, tokens, head_dim]."""
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        view = (1, hidden.shape[1], -1, shape.head_dim)
        q, k, v = (p.view(view) for p in _qkv(attn, x))
        if shape.head_norms:  # (over head_dim, before the rotary embeddings: Qwen3Attention's order)
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (p.transpose(1, 2) for p in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    @staticmethod
    def finish(layer, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: output projection, MLP and the residual adds."""
        hidden = hidden + layer.self_attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @staticmethod
    def logits(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_head(model.model.norm(hidden))


TORCH_LAYERS = TorchLayers()


def _qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values: one fused matmul where the weights have one (app.model.int8), else three."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return fused(x).split([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features], dim=-1)


@torch.inference_mode()
def ragged_forward(model, rows: list[Row]) -> list[torch.Tensor]:
    """Run every row's new tokens through `model` in one pass; return each row's last `keep` logits. If it raises,
    caches may be partly extended: the caller rolls them back (TokenCache.rollback)."""
    inner = model.model
    spans, at = [], 0
    for row in rows:
        spans.append((at, at + len(row.ids)))
        at += len(row.ids)
    ids = torch.tensor([[t for row in rows for t in row.ids]])
    positions = torch.cat([torch.arange(row.start, row.start + len(row.ids)) for row in rows]).unsqueeze(0)
    shared = [row.prefix.get_seq_length() if row.prefix is not None else 0 for row in rows]
    config = model.config
    shape = shape_of(model)
    groups = shape.groups
    repeat = shape.heads // groups
    fast = attend_rows.available(config)  # (attend_rows, in C: each row decides alone, by its own tokens)
    readable: dict[int, bool] = {}
    few = [i for i, row in enumerate(rows)
           if fast and attend_rows.batched(len(row.ids), row.kv, row.prefix, readable)]
    in_c = set(few)
    rest = [i for i in range(len(rows)) if i not in in_c]  # (prefill chunks: PyTorch's kernels, with masks)
    masks = {i: causal_mask(len(rows[i].ids), rows[i].start - shared[i], None if rows[i].prefix is None else repeat)
             for i in rest}
    readers = _prefix_readers(rows, skip=in_c)
    layers = fused_layers(model) or TORCH_LAYERS
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    batch = None  # (made at the first layer, from its keys' shape)
    if few and len(few) == len(rows) and layers is not TORCH_LAYERS:  # all rows in C: maybe all layers in one call
        batch = attend_rows.Batch(rows, spans, hidden.new_empty(1, groups, 0, shape.head_dim))
        if layers.whole_pass(model, shape, hidden, cos, sin, batch):
            return _logits(model, layers, hidden, rows, spans)
    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q, k, v = layers.attention_inputs(layer, shape, hidden, cos, sin)
        heads = _prefix_attention(q, rows, spans, readers, index, attn.scaling)
        out = torch.empty(at, q.shape[1], q.shape[3])
        if few:
            batch = batch or attend_rows.Batch([rows[i] for i in few], [spans[i] for i in few], k)
            batch.attend(q, k, v, index, attn.scaling, out)
        for i in rest:
            row, (a, b), mask = rows[i], spans[i], masks[i]
            keys, values = row.kv.update(k[:, :, a:b], v[:, :, a:b], index)
            if row.prefix is None:
                part = _attend(q[:, :, a:b], keys, values, mask, attn.scaling)
            else:
                part = _merge(*heads[i], *_attend_lse(q[:, :, a:b], keys, values, mask, attn.scaling))
            out[a:b] = part[0].transpose(0, 1)
        hidden = layers.finish(layer, hidden, out.view(1, at, -1))
    return _logits(model, layers, hidden, rows, spans)


def _logits(model, layers, hidden: torch.Tensor, rows: list[Row], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each row's last `keep` logits."""
    kept = torch.cat([torch.arange(b - row.keep, b) for row, (_, b) in zip(rows, spans)])
    logits = layers.logits(model, hidden[:, kept])[0]
    return list(logits.split([row.keep for row in rows]))
