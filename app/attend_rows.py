"""A row's attention in C (app/attend_rows.c) where it has few queries over few keys: a decoding row early in
its session, or a few drafted tokens.

Why: PyTorch's CPU flash kernel costs ~37 us a call whatever the work, and a ragged step makes one call per row
and layer (240 for 8 rows), plus four small operations per row to merge it with the shared prefix's part. One
C call does both in 14 us for one query over 50 keys, 23 us over 100 (9 heads; 58 against 45 us over 300, where
the kernel's blocked matmuls win, so longer rows stay with it). A row's path depends on its own query and key
counts only, and C computes each query alone, so a row's bits never depend on the rows beside it.
"""

from __future__ import annotations

import torch

from app.native import library

WORK_IN_C = 256  # up to this many query x key pairs a row's attention runs in C (measured crossing: ~200-300)


def attend_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               prefix: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """One row's causal attention of its n new queries ([1, heads, n, dim]) over its past + n keys ([1, groups,
    past + n, dim]), merged with its attention over a shared prefix (output, log-sum-exp) if given; None where
    the row is too big for C or its tensors are not laid out for it (the caller then runs PyTorch's kernel)."""
    lib = library()
    _, heads, n, dim = query.shape
    length = keys.shape[2]
    if lib is None or n * length > WORK_IN_C or not _fits(query, keys, values, prefix):
        return None
    out = torch.empty(n, heads, dim)
    head_out, head_lse = prefix if prefix is not None else (None, None)
    failed = lib.attend_row(query.data_ptr(), query.stride(1), query.stride(2), n, keys.data_ptr(),
                            values.data_ptr(), keys.stride(1), length - n, heads, keys.shape[1], dim, scale,
                            None if head_out is None else head_out.data_ptr(),
                            None if head_lse is None else head_lse.data_ptr(), out.data_ptr())
    if failed:
        raise MemoryError("attend_row: no memory for a row's scores")
    return out.view(1, n, heads, dim).transpose(1, 2)


def _fits(query, keys, values, prefix) -> bool:
    dim = query.shape[-1]
    tensors = [query, keys, values, *(prefix or ())]
    return (all(t.dtype == torch.float32 and t.is_cpu for t in tensors) and query.stride(-1) == 1
            and keys.stride(-1) == 1 and keys.stride(2) == dim and values.stride() == keys.stride()
            and (prefix is None or all(t.is_contiguous() for t in prefix)))
