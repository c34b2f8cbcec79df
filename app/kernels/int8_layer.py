"""An int8 decoder layer with its work between the matmuls (norms, splits, scaling, rotary, SiLU, residual adds) in a
few C calls (app/kernels/int8_layer.c), for app.model.ragged; where every row attends in C, one call runs all the layers
without the GIL. Each token is computed alone in a fixed order, so its bits do not depend on the rows beside it; without
the C library the layers run as torch modules."""

from __future__ import annotations

import ctypes

import torch

from app.kernels.int8_rows import ACT_MAX, FINE, by_dtype, empty_parts, pointer
from app.kernels.native import library


def fused_layers(model) -> FusedInt8Layers | None:
    """The fused layers for a model converted by app.model.int8.to_int8, where the C library is built; else None."""
    lib = library()
    layer = model.model.layers[0]
    if lib is None or not (hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up")
                           and model.config.hidden_act == "silu" and hasattr(model.lm_head, "sums")
                           and hasattr(layer.input_layernorm, "variance_epsilon")
                           and getattr(model.config, "partial_rotary_factor", 1.0) == 1.0):  # rotary on whole heads
        return None
    return FusedInt8Layers(lib)


class FusedInt8Layers:
    """What app.model.ragged asks of a layer, in the fused calls: q/k/v for attention, then the rest of the layer.
    `hidden` is [1, tokens, width], contiguous float32, and is updated in place."""

    def __init__(self, lib):
        self.lib = lib  # (every tensor whose address goes to C is held in a local until the call returns)

    @staticmethod
    def _room(n: int, linear) -> tuple[torch.Tensor, torch.Tensor]:
        """Parts (and scales) for n rows of `linear`'s input, in the dtype its kernel reads for n tokens."""
        return empty_parts(n, linear.in_features, linear.parts_dtype(n))

    def _norm_split(self, x: torch.Tensor, norm, linear) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = x.shape
        parts, scale = self._room(n, linear)
        self.lib.norm_split(x.data_ptr(), n, d, norm.weight.data_ptr(), norm.variance_epsilon, ACT_MAX, FINE,
                            *by_dtype(parts), scale.data_ptr())
        return parts, scale

    def attention_inputs(self, layer, shape, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries and keys (head-normed where `shape.head_norms`, then rotated) and values, each [1, heads, tokens,
        head_dim]."""
        attn, x = layer.self_attn, hidden[0]
        qkv, norm = attn.qkv_proj, layer.input_layernorm
        n = len(x)
        widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        rotated = (widths[0] + widths[1]) // attn.head_dim
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        assert cos.shape == (n, attn.head_dim), "C rotates whole heads: cos/sin must cover head_dim"
        q_norm, k_norm, head_eps = _head_norms(layer, shape)
        if _packed(n, qkv):
            y = torch.empty(n, qkv.out_features)
            _check(self.lib.qkv_packed(x.data_ptr(), n, x.shape[1], norm.weight.data_ptr(), norm.variance_epsilon,
                                       ACT_MAX, FINE, ctypes.byref(_linear(qkv)), rotated, attn.head_dim,
                                       cos.data_ptr(), sin.data_ptr(), shape.heads, q_norm, k_norm, head_eps,
                                       y.data_ptr()))
        else:
            parts, scale = self._norm_split(x, norm, qkv)
            y = qkv.scaled(parts, scale)
            if q_norm is not None:
                self.lib.norm_heads(y.data_ptr(), n, qkv.out_features, 0, shape.heads, attn.head_dim, q_norm,
                                    head_eps)
                self.lib.norm_heads(y.data_ptr(), n, qkv.out_features, shape.heads, rotated - shape.heads,
                                    attn.head_dim, k_norm, head_eps)
            self.lib.rotate(y.data_ptr(), n, qkv.out_features, rotated, attn.head_dim, cos.data_ptr(),
                            sin.data_ptr())
        return tuple(p.view(1, n, -1, attn.head_dim).transpose(1, 2) for p in y.split(widths, dim=-1))

    def finish(self, layer, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The attention's output projection, the residual adds and the MLP, into `hidden`."""
        x, o_proj, mlp = hidden[0], layer.self_attn.o_proj, layer.mlp
        n, width = x.shape
        norm, gate_up = layer.post_attention_layernorm, mlp.gate_up
        out = out.reshape(n, -1).contiguous()
        if _packed(n, o_proj, gate_up, mlp.down_proj):
            _check(self.lib.finish_packed(out.data_ptr(), n, x.data_ptr(), ctypes.byref(_linear(o_proj)),
                                          norm.weight.data_ptr(), norm.variance_epsilon, ctypes.byref(_linear(gate_up)),
                                          ctypes.byref(_linear(mlp.down_proj)), ACT_MAX, FINE))
            return hidden
        parts, scale = o_proj.split(out)
        sums = o_proj.sums(parts)
        # the output projection's residual add, then the MLP's norm and split for gate/up
        parts, up_scale = self._room(n, gate_up)
        self.lib.combine_add_norm_split(*by_dtype(sums), n, width, FINE, scale.data_ptr(), o_proj.scale.data_ptr(),
                                        pointer(o_proj.bias), x.data_ptr(), norm.weight.data_ptr(),
                                        norm.variance_epsilon, ACT_MAX, *by_dtype(parts), up_scale.data_ptr())
        sums = gate_up.sums(parts)
        # SiLU(gate) * up, split for the down projection
        down = mlp.down_proj
        parts, scale = self._room(n, down)
        self.lib.combine_silu_split(*by_dtype(sums), n, gate_up.out_features, FINE, up_scale.data_ptr(),
                                    gate_up.scale.data_ptr(), pointer(gate_up.bias), ACT_MAX, *by_dtype(parts),
                                    scale.data_ptr())
        sums = down.sums(parts)
        # the down projection's residual add
        self.lib.combine_add(*by_dtype(sums), n, width, FINE, scale.data_ptr(), down.scale.data_ptr(),
                             pointer(down.bias), x.data_ptr())
        return hidden

    def whole_pass(self, model, shape, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch) -> bool:
        """Every layer in one C call, where every row attends in `batch` (an attend_rows.Batch) and every layer has the
        packed kernel; False, with nothing done, otherwise. Updates `hidden` in place."""
        layers, x = model.model.layers, hidden[0]
        n = len(x)
        if not all(linear.packed for linear in _linears(model)):
            return False
        attn = layers[0].self_attn
        heads, groups = shape.heads, shape.groups
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        status = self.lib.forward_layers(_stack(model, shape), len(layers), x.data_ptr(), n, x.shape[1], heads,
                                         groups, attn.head_dim, attn.scaling, cos.data_ptr(), sin.data_ptr(),
                                         batch.table_pointers, batch.count, ACT_MAX, FINE)
        if status == -2:  # (another geometry: nothing done)
            return False
        _check(status)
        return True

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head, for [1, tokens, width] hidden states."""
        head = model.lm_head
        parts, scale = self._norm_split(hidden[0].contiguous(), model.model.norm, head)
        return head.scaled(parts, scale).unsqueeze(0)


class Linear(ctypes.Structure):
    """An int8 layer as app/kernels/int8_layer.c's packed functions read it (its `Linear`)."""

    _fields_ = [("packed", ctypes.c_void_p), ("colsum", ctypes.c_void_p), ("wscale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]


class LayerC(ctypes.Structure):
    """A decoder layer as app/kernels/int8_layer.c's forward_layers reads it (its `Layer`)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("input_eps", ctypes.c_float), ("qkv", Linear),
                ("post_norm", ctypes.c_void_p), ("post_eps", ctypes.c_float), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("head_eps", ctypes.c_float)]


def _linears(model) -> list:
    """Every decoder layer's q/k/v, output, gate/up and down Int8Linear, listed once per model."""
    made = model.__dict__.get("_c_linears")
    if made is None:
        made = [linear for layer in model.model.layers for linear in
                (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj)]
        model.__dict__["_c_linears"] = made
    return made


def _head_norms(layer, shape) -> tuple[int | None, int | None, float]:
    """The addresses of a layer's per-head query and key norm weights and their epsilon; (None, None) where the family
    has none."""
    if not shape.head_norms:
        return None, None, 0.0
    attn = layer.self_attn
    return attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr(), attn.q_norm.variance_epsilon


def _stack(model, shape) -> ctypes.Array:
    """The C view of every decoder layer, made once per model (its tensors never move)."""
    made = model.__dict__.get("_c_layers")
    if made is None:
        linears = _linears(model)
        made = (LayerC * len(model.model.layers))(*[
            LayerC(layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.variance_epsilon,
                   _linear(qkv), layer.post_attention_layernorm.weight.data_ptr(),
                   layer.post_attention_layernorm.variance_epsilon, _linear(o), _linear(gate_up), _linear(down),
                   *_head_norms(layer, shape))
            for layer, (qkv, o, gate_up, down) in zip(model.model.layers, zip(*[iter(linears)] * 4))])
        model.__dict__["_c_layers"] = made
    return made


def _packed(tokens: int, *linears) -> bool:
    """Whether these layers run on the packed kernel for this many tokens (then one C call does their work)."""
    return all(linear.packed_for(tokens) for linear in linears)


def _linear(linear) -> Linear:
    """The C view of an Int8Linear on the packed kernel, made once and kept on the layer (its tensors never move)."""
    made = linear.__dict__.get("_c_linear")
    if made is None:
        weight = linear.prepare()._packed
        made = Linear(weight.packed.data_ptr(), weight.colsum.data_ptr(), linear.scale.data_ptr(),
                      pointer(linear.bias), linear.in_features, linear.out_features)
        linear.__dict__["_c_linear"] = made
    return made


def _check(status: int) -> None:
    if status:
        raise MemoryError("the packed int8 layer could not get memory")
