"""The per-token work around an int8 matmul: splitting each activation row into two 7-bit parts with its own scale, and
scaling the integer sums back. In C where a compiler is at hand (one call instead of many small torch ones), else in
torch, with the same bits."""

from __future__ import annotations

import torch

from app.kernels.native import library

QMAX = 127  # a weight's largest int8 value
ACT_MAX = 63  # an activation part's: 7 bits (app.model.int8's docstring)
FINE = 2 * ACT_MAX  # |rounding error| <= 1/2 step, so FINE steps of it fit in [-ACT_MAX, ACT_MAX]
ROUNDER = 1.5 * 2**23  # a float32 of magnitude below 2**22 plus this lies where floats are the integers


def _row_scale(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """One float32 scale per row: its largest magnitude over qmax (a zero row gets a tiny one, not a division by 0)."""
    # abs().amax(): an inf-norm's values, faster
    return x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(qmax)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) with x ≈ values * scale (the weights' one-time quantization, torch only)."""
    scale = _row_scale(x, QMAX)
    return torch.round(x / scale).to(torch.int8), scale


def split_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x as ([high; low], scale), x ≈ (high + low / FINE) * scale: two 7-bit parts."""
    return _split(x, torch.int8)


def split_rows_float(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split_rows with the parts' integer values left in float32, as the exact kernel reads them."""
    return _split(x, torch.float32)


def combine_rows(sums: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """(high + low / FINE) * scale * weight_scale (+ bias) from a matmul's sums (int32 or float32) over split
    rows: the high parts' rows, then the low parts'."""
    lib = library()
    if lib is None or not _fits(sums):
        return combine_rows_torch(sums, scale, weight_scale, bias)
    n, width = len(sums) // 2, sums.shape[1]
    out = torch.empty(n, width)
    lib.combine_rows(*by_dtype(sums), n, width, FINE, scale.data_ptr(), weight_scale.data_ptr(), pointer(bias),
                     out.data_ptr())
    return out


def _split(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    if lib is None or x.dtype != torch.float32 or not _fits(x):
        parts, scale = split_rows_torch(x)
        return parts.to(dtype), scale
    n, width = x.shape
    parts, scale = empty_parts(n, width, dtype)
    lib.split_rows(x.data_ptr(), n, width, ACT_MAX, FINE, *by_dtype(parts), scale.data_ptr())
    return parts, scale


def empty_parts(n: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for n rows split in two parts (int8, or their values as float32) and their scales, for C to fill."""
    return torch.empty(2 * n, width, dtype=dtype), torch.empty(n, 1)


def by_dtype(t: torch.Tensor) -> tuple[int | None, int | None]:
    """(address, None) for float32 data, (None, address) for int8 or int32: how the C functions take either."""
    return (t.data_ptr(), None) if t.dtype == torch.float32 else (None, t.data_ptr())


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fits(x: torch.Tensor) -> bool:
    """Whether C can read x as it is: contiguous float32 or int32 in CPU memory (the scales and biases are)."""
    return x.dtype in _C_TYPES and x.is_cpu and x.is_contiguous()


_C_TYPES = (torch.float32, torch.int32)


def split_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split_rows in torch, the parts' values in float32: what the C code computes, one operation at a time."""
    scale = _row_scale(x, ACT_MAX)
    scaled = x / scale
    high = round_(scaled.clone())
    low = round_(scaled.sub_(high).mul_(FINE))
    return torch.cat([high, low]), scale


def combine_rows_torch(sums: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """combine_rows in torch."""
    sums = sums.float()
    n = len(sums) // 2
    out = sums[:n].add_(sums[n:], alpha=1 / FINE).mul_(scale).mul_(weight_scale)
    return out if bias is None else out.add_(bias)


def round_(x: torch.Tensor) -> torch.Tensor:
    """torch.round's values for |x| < 2**22, in place, by an add (which stays on one core)."""
    return x.add_(ROUNDER).sub_(ROUNDER)
