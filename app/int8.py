"""Int8 weights times int8 activations: the model's matmuls in exact integer arithmetic, per token.

Why: a float32 decode step of the bundled model reads 540 MB of weights, and on this CPU the matmuls are most
of the step. Int8 weights are a quarter of the bytes, and `torch._int_mm` multiplies int8 by int8 into int32
with the CPU's VNNI instructions (measured: the LM head 1.6 ms against 11.5 ms in float32). Without VNNI it is
far slower than float32, so the default format is chosen by timing both (`int8_matmul_is_fast`).

Why per token: each token's activations get their own scale, and the integer products are exact, so a token's
result depends on that token alone: not on the rows batched beside it in a step, nor on how a prefill was
chunked (tested bitwise). Library routes quantize a whole input tensor with one scale (`torch.ao` dynamic
int8), which would make a session's answer depend on who else was in the step.

Why two parts per activation (`split_rows`): with one, int8's rounding of activations cost more accuracy than
the int8 weights did. Weights get one scale per output channel. Embeddings, norms and attention stay float32,
and so does the embedding table, which the LM head no longer shares once converted.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from app.ragged import supports

log = logging.getLogger(__name__)

QMAX = 127
FINE = 2 * QMAX  # |rounding error| <= 1/2 step, so FINE steps of it fit in [-QMAX, QMAX]


def _row_scale(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row: its largest magnitude over QMAX (a zero row gets a tiny one, not a division
    by zero)."""
    # (abs().amax(): the same values as an inf-norm, ~5x faster on a [80, 576] step input: 14 vs 79 us)
    return x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(QMAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) with x ≈ values * scale, each row scaled by its own largest value."""
    scale = _row_scale(x)
    return torch.round(x / scale).to(torch.int8), scale


def split_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as two int8 parts: x ≈ (high + low / FINE) * scale, returned as ([high; low], scale).

    One int8 part per token keeps about 8 bits of each activation, and that rounding was most of int8's error
    (measured on the system prompt and questions: 92.9 % of next tokens agreed with float32, 97.9 % with only
    the weights in int8). The second part holds the first one's rounding error (at most half a step, so FINE
    steps per step fit int8): ~15 bits in all. Both parts go through one matmul, and at decode a step is bound
    by reading the weights, which serve the second part at no extra cost."""
    scale = _row_scale(x)
    scaled = x / scale
    high = torch.round(scaled)
    low = scaled.sub_(high).mul_(FINE).round_()
    return torch.cat([high, low]).to(torch.int8), scale


SKINNY_ROWS = 64  # up to this many activation rows, _float_mm multiplies as W·xᵀ (measured faster for 2-48)
EXACT_SPAN = 1024  # float32 holds every integer below 2**24, and 1024 products of int8s stay below it (127**2 * 1024)


def exact_int_mm(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`torch._int_mm(parts, weight.T).float()` for int8 values held in float32, bit for bit, on a CPU whose int8
    matmul is slow (no VNNI: ~30x slower than float32 there, see int8_matmul_is_fast).

    Why it is exact: every product is an integer below 2**14, and every partial sum over at most EXACT_SPAN
    of them stays below 2**24, where float32 adds integers exactly in any order, so a kernel's blocking cannot
    change the result. A longer row is summed as two spans, each exact; adding the two rounds once, to the float
    nearest the exact total, which is what converting int_mm's int32 total to float does."""
    inner = parts.shape[1]
    if inner <= EXACT_SPAN:
        return _float_mm(parts, weight)
    half = inner // 2
    return _float_mm(parts[:, :half], weight[:, :half]).add_(_float_mm(parts[:, half:], weight[:, half:]))


def _float_mm(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """parts @ weight.T, as W·partsᵀ for a few rows: with torch's MKL on an AVX2 EPYC, x·Wᵀ of 2-48 rows cost
    up to 2.4x one row's (the LM head at 2 rows: 24 vs 7.4 ms), W·xᵀ did not. Exact sums make the two forms give
    the same bits, so the faster one is free to choose."""
    if len(parts) <= SKINNY_ROWS:
        return (weight @ parts.t()).t().contiguous()
    return parts @ weight.t()


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output channel) and x in two int8 parts per token."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 weight32: torch.Tensor | None = None):
        """`weight32`: the same values in float32, to multiply with exact_int_mm instead of torch._int_mm."""
        super().__init__()
        assert weight.dtype == torch.int8 and weight.dim() == 2 and scale.shape == weight.shape[:1]
        assert weight32 is None or weight.shape[1] <= 2 * EXACT_SPAN, "exact_int_mm covers at most two spans"
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.register_buffer("weight32", weight32, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   exact_float: bool = False) -> Int8Linear:
        values, scale = quantize_rows(weight.detach().float())
        bias = None if bias is None else bias.detach().float().clone()
        return cls(values, scale.squeeze(1), bias, values.float() if exact_float else None)

    @classmethod
    def fused(cls, *linears: nn.Module, exact_float: bool = False) -> Int8Linear:
        """Layers that read the same input as one: their outputs side by side, in order."""
        biases = [linear.bias for linear in linears]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        return cls.from_float(torch.cat([linear.weight for linear in linears]), bias, exact_float)

    def rows(self, start: int, stop: int) -> Int8Linear:
        """Output channels start..stop as their own layer, sharing this one's memory."""
        bias = None if self.bias is None else self.bias[start:stop]
        weight32 = None if self.weight32 is None else self.weight32[start:stop]
        return Int8Linear(self.weight[start:stop], self.scale[start:stop], bias, weight32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        parts, scale = split_rows(flat)
        if self.weight32 is None:
            both = torch._int_mm(parts, self.weight.t()).float()  # exact: int8 products summed in int32
        else:
            both = exact_int_mm(parts.float(), self.weight32)  # the same bits, on float32 hardware
        out = both[:len(flat)].add_(both[len(flat):], alpha=1 / FINE).mul_(scale).mul_(self.scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8MLP(nn.Module):
    """A gated MLP with gate and up projections in one matmul (one activation quantization, one kernel)."""

    def __init__(self, mlp: nn.Module, exact_float: bool = False):
        super().__init__()
        self.gate_up = Int8Linear.fused(mlp.gate_proj, mlp.up_proj, exact_float=exact_float)
        self.down_proj = Int8Linear.from_float(mlp.down_proj.weight, mlp.down_proj.bias, exact_float)
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fuse_attention(attn: nn.Module, exact_float: bool) -> None:
    """q/k/v as one int8 matmul (`attn.qkv_proj`, what the ragged pass calls) and as three views of it (what
    transformers' own forward calls): both compute the same numbers."""
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    attn.qkv_proj = Int8Linear.fused(*parts, exact_float=exact_float)
    at = 0
    for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
        setattr(attn, name, attn.qkv_proj.rows(at, at + part.out_features))
        at += part.out_features
    attn.o_proj = Int8Linear.from_float(attn.o_proj.weight, attn.o_proj.bias, exact_float)


@functools.cache
def int8_matmul_is_fast() -> bool:
    """Whether `torch._int_mm` beats a float32 matmul on this CPU, timed once per process (~0.1 s at worst).

    Where the CPU has VNNI, int8 products run ~4-7x faster than float32 (the LM head 1.6 vs 11.5 ms); without it
    torch falls back to a scalar loop (an AVX2-only AMD EPYC: 46 ms against float32's 1.4 ms for an MLP-sized
    matmul of 16 rows, ~30x slower, and a 10-token greeting took minutes; this probe's own matmul there: 4.4-5.4
    against 1.4-1.7 ms). A timing decides, not a CPU flag, because which instructions torch's int8 kernel uses
    is its own business; the two machine kinds are a factor of ~25 apart, far beyond a shared machine's noise."""
    # one decode token (two int8 parts against one float32 row) through an LM-head-like 8,192 x 576 matrix:
    # 19 MB in float32, more than a core's caches hold, so the timing includes reading the weights, as in a step
    rows, inner, out = 1, 576, 8192
    parts = torch.randint(-QMAX, QMAX + 1, (2 * rows, inner), dtype=torch.int8)
    weight = torch.randint(-QMAX, QMAX + 1, (out, inner), dtype=torch.int8)
    x, weight32 = torch.randn(rows, inner), torch.randn(out, inner)

    def best(run) -> float:
        run()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    return best(lambda: torch._int_mm(parts, weight.t())) < best(lambda: x @ weight32.t())


@torch.no_grad()
def to_int8(model: nn.Module, exact_float: bool | None = None) -> None:
    """Convert a Llama-family model's projections, MLPs and LM head to int8, in place. `exact_float`: multiply
    with exact_int_mm (the same bits as torch._int_mm, at float32's speed, with a float32 copy of the weights);
    None: where int8 matmuls are slow on this CPU and every layer's rows are short enough for it."""
    if not supports(model):
        raise ValueError(f"int8 weights cover Llama-family models; {model.config.model_type} is not one")
    if exact_float is None:
        cfg = model.config
        exact_float = not int8_matmul_is_fast() and max(cfg.hidden_size, cfg.intermediate_size) <= 2 * EXACT_SPAN
        if exact_float:
            log.info("int8 matmuls are slow on this CPU: int8 runs on the exact float32 kernel (the same bits)")
    for layer in model.model.layers:
        _fuse_attention(layer.self_attn, exact_float)
        layer.mlp = Int8MLP(layer.mlp, exact_float)
    model.lm_head = Int8Linear.from_float(model.lm_head.weight, model.lm_head.bias, exact_float)
    model.config.tie_word_embeddings = False  # the embedding table stays float32 on its own
