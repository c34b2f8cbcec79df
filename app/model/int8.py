"""Int8 weights times int8 activations: the model's matmuls in exact integer arithmetic, per token. `torch._int_mm`
multiplies them with VNNI; where it is slow the same integer products run exactly on `ExactWeight`, and few tokens go to
a kernel without a per-call weight relayout. Each token's activations get their own scale and two 7-bit parts, so its
result depends on that token alone, not on the rows beside it or on how a prefill was chunked. Embeddings, norms and
attention stay float32."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from app.kernels import int8_mm
from app.kernels.int8_mm import PackedWeight
from app.kernels.int8_rows import ACT_MAX, FINE, QMAX, combine_rows, quantize_rows, split_rows, split_rows_float
from app.model.family import fast_path_reason
from app.model.ragged import supports
from app.model.timing import best_of

log = logging.getLogger(__name__)

SKINNY_ROWS = 64  # up to this many activation rows, the float32 form multiplies as W·xᵀ
EXACT_SPAN = 2048  # float32 holds every integer below 2**24, and 2048 products stay below it (63 * 127 * 2048)


_FBGEMM_MM = "linear_with_input_q_dq_qweight_dq_output_fp32"  # float input, its quantization given, float output
ZERO_POINT = ACT_MAX + 1  # a 7-bit part v in [-ACT_MAX, ACT_MAX] goes to fbgemm as the unsigned byte v + 64


def fbgemm_int8() -> bool:
    """Whether this torch has fbgemm's int8 matmul with the activations' quantization given (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, _FBGEMM_MM)


class ExactWeight:
    """An int8 weight multiplied with the same bits as `torch._int_mm(parts, weight.T)` on another kernel: for CPUs
    where `_int_mm` is slow, and for few tokens.

    On fbgemm's kernel the activations go in with scale 1 and zero point 64 and the weight with scale 1, so the result
    is the exact int32 sum as a float. Else in float32: every partial sum of at most EXACT_SPAN products stays below
    2**24, where float32 adds integers exactly in any order."""

    def __init__(self, weight: torch.Tensor, fbgemm: bool | None = None):
        assert weight.dtype == torch.int8 and weight.dim() == 2
        self.fbgemm = fbgemm_int8() if fbgemm is None else fbgemm
        assert self.fbgemm or weight.shape[1] <= EXACT_SPAN, "float32 sums are exact up to EXACT_SPAN products"
        self._weight = weight
        self._held = None  # held on first use, or by prepare()

    def prepare(self) -> ExactWeight:
        """Hold the weight for the kernel now rather than on first use."""
        if self._held is None:
            if self.fbgemm:
                with warnings.catch_warnings():  # quantized tensors are deprecated
                    warnings.simplefilter("ignore", UserWarning)
                    whole = torch._make_per_tensor_quantized_tensor(self._weight.contiguous(), 1.0, 0)
                self._held = torch.ops.quantized.linear_prepack(whole, None)
            else:
                self._held = self._weight.float().contiguous()
        return self

    def mm(self, parts: torch.Tensor) -> torch.Tensor:
        """parts @ weight.T for 7-bit values held in float32 (one row per token part)."""
        held = self.prepare()._held
        if not self.fbgemm:
            return _float_mm(parts, held)
        return getattr(torch.ops.quantized, _FBGEMM_MM)(parts, 1.0, ZERO_POINT, held)


def _float_mm(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """parts @ weight.T, as W·partsᵀ for few rows; exact sums give both forms the same bits."""
    if len(parts) <= SKINNY_ROWS:
        return (weight @ parts.t()).t().contiguous()
    return parts @ weight.t()


FEW_TOKENS = 8  # where _int_mm is fast, inputs of up to this many tokens take fbgemm's kernel (kernels_for)
PACKED_FEW_TOKENS = 16  # ... or up to this many app.kernels.int8_mm's


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output channel) and x in two int8 parts per token."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 exact: bool = False, few: int | None = None, packed: bool = False):
        """`exact`: multiply on ExactWeight, `packed`: on app.kernels.int8_mm's kernel (both the same bits as
        torch._int_mm); `few`: either only for inputs of up to this many tokens (None: all)."""
        super().__init__()
        assert weight.dtype == torch.int8 and weight.dim() == 2 and scale.shape == weight.shape[:1]
        assert not (exact and packed), "one kernel for few tokens"
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.exact = ExactWeight(weight) if exact else None  # derived from `weight`: not a buffer
        self.packed = packed
        self._packed: PackedWeight | None = None  # made by prepare(), or on first use
        self.few = few
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def prepare(self) -> Int8Linear:
        """Lay the weight out for its few-token kernel now rather than on first use."""
        if self.exact is not None:
            self.exact.prepare()
        elif self.packed and self._packed is None:
            self._packed = PackedWeight(self.weight)
        return self

    @property
    def prepared(self) -> bool:
        """Whether its weight is laid out for its few-token kernel (by prepare() or a first use; True: none)."""
        if self.exact is not None:
            return self.exact._held is not None
        return not self.packed or self._packed is not None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   exact: bool = False, few: int | None = None, packed: bool = False) -> Int8Linear:
        values, scale = quantize_rows(weight.detach().float())
        bias = None if bias is None else bias.detach().float().clone()
        return cls(values, scale.squeeze(1), bias, exact, few, packed)

    @classmethod
    def fused(cls, *linears: nn.Module, exact: bool = False, few: int | None = None,
              packed: bool = False) -> Int8Linear:
        """Layers that read the same input as one: their outputs side by side, in order."""
        biases = [linear.bias for linear in linears]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        return cls.from_float(torch.cat([linear.weight for linear in linears]), bias, exact, few, packed)

    def rows(self, start: int, stop: int) -> Int8Linear:
        """Output channels start..stop as their own layer, sharing this one's int8 memory (an exact kernel's weight is
        held again)."""
        bias = None if self.bias is None else self.bias[start:stop]
        return Int8Linear(self.weight[start:stop], self.scale[start:stop], bias, self.exact is not None, self.few,
                          self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        parts, scale = self.split(flat)
        return self.scaled(parts, scale).view(*x.shape[:-1], self.out_features)

    def scaled(self, parts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The layer's output from split rows, scaled back; in one call where the packed kernel takes them, the same
        bits either way."""
        if parts.dtype == torch.int8 and self.packed_for(len(parts) // 2):
            out = self.prepare()._packed.combined(parts, scale, self.scale, self.bias, FINE)
            if out is not None:
                return out
        return combine_rows(self.sums(parts), scale, self.scale, self.bias)

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of input split into parts, in the dtype this layer's kernel reads for that many tokens."""
        return (split_rows_float if self.parts_dtype(len(flat)) == torch.float32 else split_rows)(flat)

    def parts_dtype(self, tokens: int) -> torch.dtype:
        """float32 where an input of this many tokens goes to the exact kernel, else int8."""
        return torch.float32 if self.exact is not None and self._few(tokens) else torch.int8

    def _few(self, tokens: int) -> bool:
        return self.few is None or tokens <= self.few

    def packed_for(self, tokens: int) -> bool:
        """Whether an input of this many tokens goes to the packed kernel."""
        return self.packed and self._few(tokens)

    def sums(self, parts: torch.Tensor) -> torch.Tensor:
        """parts @ weight.T: int32 sums for int8 parts, the same sums as floats from the exact kernel for float parts.
        """
        if parts.dtype != torch.int8:
            return self.exact.mm(parts)
        if self.packed_for(len(parts) // 2):
            sums = self.prepare()._packed.mm(parts)
            if sums is not None:
                return sums
        return torch._int_mm(parts, self.weight.t())  # exact: int8 products summed in int32

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8MLP(nn.Module):
    """A gated MLP with gate and up projections in one matmul (one activation quantization, one kernel)."""

    def __init__(self, gate_up: Int8Linear, down_proj: Int8Linear, act_fn: nn.Module):
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = gate_up, down_proj, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fuse_attention(attn: nn.Module, qkv: Int8Linear, o_proj: Int8Linear) -> None:
    """q/k/v as one int8 matmul (`attn.qkv_proj`, for the ragged pass) and as three views of it (for transformers' own
    forward)."""
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    attn.qkv_proj, at = qkv, 0
    for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
        setattr(attn, name, qkv.rows(at, at + part.out_features))
        at += part.out_features
    attn.o_proj = o_proj


@functools.cache
def int8_matmul_is_fast() -> bool:
    """Whether `torch._int_mm` beats a float32 matmul on this CPU, timed once per process. A timing rather than a CPU
    flag, since torch's kernel choice is its own and the two cases lie far apart."""
    # one decode token through an LM-head-sized matrix, larger than the caches, as in a step
    rows, inner, out = 1, 576, 8192
    parts = torch.randint(-ACT_MAX, ACT_MAX + 1, (2 * rows, inner), dtype=torch.int8)
    weight = torch.randint(-QMAX, QMAX + 1, (out, inner), dtype=torch.int8)
    x, weight32 = torch.randn(rows, inner), torch.randn(out, inner)

    return best_of(lambda: torch._int_mm(parts, weight.t())) < best_of(lambda: x @ weight32.t())


@torch.no_grad()
def to_int8(model: nn.Module, exact: bool | None = None, saved: Mapping[str, torch.Tensor] | None = None,
            few: int | None = None, packed: bool = False) -> None:
    """Convert a covered model's projections (q/k/v fused), MLPs and LM head to int8 in place. `exact`, `packed`, `few`:
    as Int8Linear's (exact None: chosen for this CPU by kernels_for); `saved`: an int8_state() of this model to reuse
    instead of quantizing again."""
    if not supports(model):
        raise ValueError(f"int8 weights cover the fast path's families only: {fast_path_reason(model.config)}")
    if exact is None:
        exact, few, packed = kernels_for(model.config)

    def int8(name: str, *linears: nn.Module) -> Int8Linear:
        weight, scale, bias = (None if saved is None else saved.get(f"{name}.{key}") for key in INT8_KEYS)
        out = sum(linear.out_features for linear in linears)
        if weight is not None and weight.shape == (out, linears[0].in_features) and weight.dtype == torch.int8 \
                and scale is not None and scale.shape == (out,) and (bias is None) == (linears[0].bias is None):
            return Int8Linear(weight, scale, bias, exact, few, packed)
        return Int8Linear.fused(*linears, exact=exact, few=few, packed=packed)

    for i, layer in enumerate(model.model.layers):
        attn, mlp, at = layer.self_attn, layer.mlp, f"model.layers.{i}"
        _fuse_attention(attn, int8(f"{at}.self_attn.qkv_proj", attn.q_proj, attn.k_proj, attn.v_proj),
                        int8(f"{at}.self_attn.o_proj", attn.o_proj))
        layer.mlp = Int8MLP(int8(f"{at}.mlp.gate_up", mlp.gate_proj, mlp.up_proj),
                            int8(f"{at}.mlp.down_proj", mlp.down_proj), mlp.act_fn)
    model.lm_head = int8("lm_head", model.lm_head)
    model.config.tie_word_embeddings = False  # the embedding table stays float32 on its own
    int8_mm.available()  # the C functions, built now (once per CPU kind) rather than by the first question
    if exact or packed:
        _prepare(model)


def kernels_for(config) -> tuple[bool, int | None, bool]:
    """(exact, few, packed) for to_int8 on this CPU: app.kernels.int8_mm for every input where the library has AMX tiles
    that suit the model; else a few-token kernel (int8_mm's with VNNI, else fbgemm's) with `_int_mm` for more where
    `_int_mm` is fast; else the exact kernel for everything."""
    packed = int8_mm.available()
    if packed and int8_mm.any_tokens(config):
        return False, None, True
    if packed or int8_matmul_is_fast():
        return fbgemm_int8() and not packed, PACKED_FEW_TOKENS if packed else FEW_TOKENS, packed
    exact = fbgemm_int8() or max(config.hidden_size, config.intermediate_size) <= EXACT_SPAN
    if exact:
        log.info("torch's int8 matmul is slow on this CPU: int8 runs on the exact %s kernel (the same bits)",
                 "fbgemm" if fbgemm_int8() else "float32")
    return exact, None, False


INT8_KEYS = ("weight", "scale", "bias")
SAVED_INT8 = "int8-weights-v1.safetensors"  # int8_state()'s file (app.model); a new name when quantize_rows changes


def _own_layers(model: nn.Module) -> dict[str, Int8Linear]:
    """The converted model's int8 layers by name, less the q/k/v views (slices of qkv_proj's memory)."""
    views = {id(part) for layer in model.model.layers
             for part in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)}
    return {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear) and id(m) not in views}


def int8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What to_int8(saved=...) reads back: each int8 layer's weight, scales and bias, by the layer's name."""
    return {f"{name}.{key}": getattr(layer, key) for name, layer in _own_layers(model).items()
            for key in INT8_KEYS if getattr(layer, key) is not None}


def _prepare(model: nn.Module) -> None:
    """Lay out every weight the ragged pass reads now, two at a time, so the first question does not pay for it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="int8-prepare") as pool:
        list(pool.map(Int8Linear.prepare, _own_layers(model).values()))
