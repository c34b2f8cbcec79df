"""The int8 matmul in C (app/kernels/int8_mm.c): of few tokens with AVX-512 VNNI, of any number with AMX. The weight is
packed once at load, avoiding torch's fixed per-call costs; the sums are integers, so they are torch._int_mm's bit for
bit whatever the kernel, threads or rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.kernels.native import library

BLOCK, GROUP = 32, 4  # output channels per pair of 16-channel blocks; inner values per 32-bit lane
AMX_INNER = 64  # inner values per AMX tile (int8_mm.c's AMX_INNER): inner sizes off it stay on the VNNI loop


def available() -> bool:
    """Whether the C library was built with VNNI. Asked each time, so a test that turns C off does not fix the answer.
    """
    lib = library()
    return lib is not None and bool(lib.mm_int8_available())


def any_tokens(config) -> bool:
    """Whether this model's int8 matmuls are fast here for inputs of any length (AMX tiles: every inner size a multiple
    of AMX_INNER)."""
    lib = library()
    inner = (config.hidden_size, config.intermediate_size)
    return available() and bool(lib.mm_int8_amx()) and all(size % AMX_INNER == 0 for size in inner)


class PackedWeight:
    """An int8 weight [n, k] packed for mm_int8: [n/16, k/4, 16, 4] bytes (padded with zeros), and each output
    channel's sum of weights (the kernel's unsigned-activation offset)."""

    def __init__(self, weight: torch.Tensor):
        assert weight.dtype == torch.int8 and weight.dim() == 2
        n, k = weight.shape
        padded = F.pad(weight, (0, -k % GROUP, 0, -n % BLOCK))
        rows, inner = padded.shape
        self.packed = padded.view(rows // 16, 16, inner // GROUP, GROUP).permute(0, 2, 1, 3).contiguous()
        self.colsum = F.pad(weight.sum(dim=1, dtype=torch.int32), (0, -n % BLOCK)).contiguous()
        self.out_features, self.in_features = n, k

    def mm(self, parts: torch.Tensor) -> torch.Tensor | None:
        """parts @ weight.T as int32 sums, for int8 parts [m, k]; None if C could not (no memory)."""
        assert parts.dtype == torch.int8 and parts.shape[1] == self.in_features and parts.is_contiguous()
        out = torch.empty(len(parts), self.out_features, dtype=torch.int32)
        failed = library().mm_int8(parts.data_ptr(), len(parts), self.in_features, self.packed.data_ptr(),
                                   self.colsum.data_ptr(), self.out_features, out.data_ptr())
        return None if failed else out

    def combined(self, parts: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 fine: float) -> torch.Tensor | None:
        """combine_rows(self.mm(parts), ...) in one C call on the tile unit, the same bits without the int32 sums in
        memory; None where the tiles do not take these parts: then call the two."""
        assert parts.dtype == torch.int8 and parts.shape[1] == self.in_features and parts.is_contiguous()
        tokens = len(parts) // 2
        out = torch.empty(tokens, self.out_features)
        failed = library().mm_int8_combined(parts.data_ptr(), tokens, self.in_features, self.packed.data_ptr(),
                                            self.colsum.data_ptr(), self.out_features, fine, scale.data_ptr(),
                                            weight_scale.data_ptr(), None if bias is None else bias.data_ptr(),
                                            out.data_ptr())
        return None if failed else out
