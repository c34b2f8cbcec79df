"""Float32 matmuls on weights packed once for oneDNN (`torch.ops.mkldnn`), where a timing at load finds that faster than
torch's default; TEXTENV_ONEDNN=0 keeps torch's. The libraries round differently, so a float32 model's bits depend on
which one a CPU gets. The layers keep their weights as parameters under their own names, and a packed copy whose weight
changed is packed again before it is read."""

from __future__ import annotations

import copy
import functools
import logging
import os

import torch
from torch import nn

from app.model.timing import best_of

log = logging.getLogger(__name__)

PACKED_ROWS = 16  # the rows oneDNN lays a weight out for; any number multiplies on it (a scheduler step's kind)
MARGIN = 0.8  # oneDNN is taken where its timing is below this share of torch's


def available() -> bool:
    """Whether this torch has oneDNN and its packed linear ops, and TEXTENV_ONEDNN does not turn them off."""
    return (os.environ.get("TEXTENV_ONEDNN", "").strip() != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] laid out for oneDNN's kernels (an opaque tensor only _linear_pointwise reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] times the packed weight, plus bias."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear's own weight and bias parameters multiplied on a packed copy; torch's linear where a gradient is
    wanted. The weight must not be an inference tensor: those keep no version counter, and reading it raises."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple[int, int, int] | None = None  # the weight packed (_source): any change moves it

    def _source(self) -> tuple[int, int, int]:
        """A key that changes with another Parameter, new storage or an in-place change (the version counter)."""
        return id(self.weight), self.weight.data_ptr(), self.weight._version

    @property
    def prepared(self) -> bool:
        """Whether it holds a packed copy of its current weight (else its next pass packs one)."""
        return self._packed is not None and self._packed_from == self._source()

    def repack(self) -> None:
        """Lay the current weight out again (after it changed)."""
        source = self._source()  # read first: a change during the packing leaves the copy marked stale
        self._packed, self._packed_from = pack(self.weight), source

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.repack()  # now, rather than in the next step

    def __getstate__(self) -> dict:
        """A copy without the packed weight, which has no storage to copy; packed on first use."""
        return {**self.__dict__, "_packed": None, "_packed_from": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias)):
            return nn.functional.linear(x, self.weight, self.bias)  # oneDNN's op has no gradient
        if self._packed_from != self._source():
            self.repack()
        flat = x.reshape(-1, self.in_features).contiguous()
        if len(flat) == 1:  # oneDNN sums a lone row in another order: pad to two
            out = packed_linear(torch.cat([flat, flat]), self._packed, self.bias)[:1]
        else:
            out = packed_linear(flat, self._packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def packed_is_faster() -> bool:
    """Whether oneDNN's packed matmul takes clearly less time (MARGIN) than torch's for a batched step's rows, timed
    once per process on a weight larger than the caches; where the two are close torch's stays, so noise does not switch
    a start's float32 bits."""
    weight, x = torch.randn(8192, 576), torch.randn(PACKED_ROWS, 576)
    packed = pack(weight)

    with torch.inference_mode():
        ours, torchs = best_of(lambda: packed_linear(x, packed, None)), best_of(lambda: nn.functional.linear(x, weight))
    return ours < MARGIN * torchs


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where `model`'s submodule `name` is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def to_packed(model: nn.Module) -> None:
    """Replace every float32 nn.Linear of `model` by a PackedLinear on the same parameters, packed now."""
    for name, linear in [(name, m) for name, m in model.named_modules()
                         if type(m) is nn.Linear and m.weight.dtype == torch.float32]:
        packed = PackedLinear(linear)
        packed.repack()
        _replace(model, name, packed)


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with nn.Linear where it has PackedLinear: the stock modules a trainer or a peer runs."""
    copy_ = copy.deepcopy(model)
    for name, module in list(copy_.named_modules()):
        if isinstance(module, PackedLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device="meta")
            linear.weight, linear.bias = module.weight, module.bias
            _replace(copy_, name, linear)
    return copy_


def use_packed(model: nn.Module) -> bool:
    """Pack `model`'s float32 linear layers where oneDNN is available and faster (logged either way); returns whether
    its layers multiply on oneDNN."""
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        log.info("float32 matmuls: oneDNN on weights packed already (a copy of a packed model)")
        return True
    if not available():
        log.info("float32 matmuls: torch's (oneDNN's packed linear is not in this torch, or TEXTENV_ONEDNN=0)")
        return False
    if not packed_is_faster():
        log.info("float32 matmuls: torch's (oneDNN's packed linear is not clearly faster on this CPU)")
        return False
    to_packed(model)
    layers = sum(isinstance(m, PackedLinear) for m in model.modules())
    log.info("float32 matmuls: oneDNN on weights packed at load (%d layers; faster than torch's here)", layers)
    return True
