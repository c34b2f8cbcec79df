"""The attention of every row with up to 64 new tokens in one C call a layer (app/kernels/attend_rows.c): it writes each
row's new keys/values into its cache's room and attends over the shared prefix (read once for all rows sharing it) and
the row's own keys. Each query runs in its own lane in a fixed order, so a row's bits never depend on the rows beside
it; longer rows stay with PyTorch's flash kernel."""

from __future__ import annotations

import ctypes

import torch

from app.kernels.native import library

# rows of up to this many new tokens attend here; longer ones (prefill chunks) in PyTorch's flash kernel
BATCH_TOKENS = 64


class RowKV(ctypes.Structure):
    """A row as attend_rows.c reads it (its RowKV); strides in floats."""

    _fields_ = [("first", ctypes.c_int64), ("n", ctypes.c_int64), ("keys", ctypes.c_void_p),
                ("values", ctypes.c_void_p), ("group_stride", ctypes.c_int64), ("past", ctypes.c_int64),
                ("prefix_keys", ctypes.c_void_p), ("prefix_values", ctypes.c_void_p),
                ("prefix_stride", ctypes.c_int64), ("prefix_len", ctypes.c_int64)]


def available(config) -> bool:
    """Whether rows of this model can attend here: the C library's AVX-512 path, for 64- or 128-value heads."""
    lib = library()
    if lib is None:
        return False
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return bool(lib.attend_fast(heads, groups, dim))


def batched(tokens: int, kv, prefix, readable: dict[int, bool] | None = None) -> bool:
    """Whether a row of this many new tokens, its cache and its shared prefix (or None) attend here, decided by the row
    alone. `readable`: a pass's memo of its prefixes' check."""
    if library() is None or tokens > BATCH_TOKENS or not all(hasattr(layer, "reserve") for layer in kv.layers):
        return False
    if prefix is None:
        return True
    memo = {} if readable is None else readable
    if id(prefix) not in memo:
        memo[id(prefix)] = all(_readable(layer) for layer in prefix.layers)
    return memo[id(prefix)]


def _readable(layer) -> bool:
    """Whether C can read a prefix layer's keys/values in place: float32 positions of head_dim values apart."""
    if not layer.is_initialized:
        return False
    keys, values = layer.keys, layer.values  # (each read of a GrowingLayer's makes a view: once here)
    if keys.numel() == 0:
        return False
    return (keys.dtype == values.dtype == torch.float32 and keys.stride() == values.stride()
            and keys.stride(-1) == 1 and keys.stride(-2) == keys.shape[-1])


def _prefix_fields(layer) -> tuple[int, int, int, int]:
    """A prefix layer's part of RowKV: its keys, values, stride between heads, length."""
    keys = layer.keys
    return keys.data_ptr(), layer.values.data_ptr(), keys.stride(1), keys.shape[2]


class Batch:
    """A pass's rows that attend here, set up once a pass: each row's room in every layer of its cache and every layer's
    RowKV table, so a layer's call passes one pointer."""

    def __init__(self, rows: list, spans: list[tuple[int, int]], like: torch.Tensor):
        """`rows` (app.model.ragged.Row) own tokens spans[i] of the pass; `like`: the pass's keys [1, groups, tokens,
        dim]. The caches cover the new positions from now on: attend() writes them layer by layer."""
        self.count = len(rows)
        self._tables = [(RowKV * len(rows))() for _ in rows[0].kv.layers] if rows else []
        prefixes: dict[int, list] = {}
        for i, (row, (a, b)) in enumerate(zip(rows, spans)):
            # each storage stays its layer's through the pass, so the addresses hold
            room = [layer.reserve(like, like, b - a) for layer in row.kv.layers]
            shared = None
            if row.prefix is not None:
                shared = prefixes.get(id(row.prefix))
                if shared is None:
                    shared = prefixes[id(row.prefix)] = [_prefix_fields(layer) for layer in row.prefix.layers]
            for index, (keys, values, past) in enumerate(room):
                entry = self._tables[index][i]
                entry.first, entry.n, entry.keys, entry.values = a, b - a, keys.data_ptr(), values.data_ptr()
                entry.group_stride, entry.past = keys.stride(1), past
                if shared is not None:
                    entry.prefix_keys, entry.prefix_values, entry.prefix_stride, entry.prefix_len = shared[index]
        # every layer's table, for a call that runs all layers (app.kernels.int8_layer's forward_layers)
        self.table_pointers = (ctypes.c_void_p * len(self._tables))(*map(ctypes.addressof, self._tables))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int, scale: float,
               out: torch.Tensor) -> None:
        """The rows' attention in layer `index`: q [1, heads, tokens, dim], k and v [1, groups, tokens, dim] of the
        whole pass (any strides). Writes each row's new keys/values into its cache's room and its tokens' outputs
        into out [tokens, heads, dim]."""
        _, heads, _, dim = q.shape
        failed = library().attend_batch(q.data_ptr(), q.stride(1), q.stride(2), k.data_ptr(), k.stride(1),
                                        k.stride(2), v.data_ptr(), v.stride(1), v.stride(2), self._tables[index],
                                        self.count, heads, k.shape[1], dim, scale, out.data_ptr())
        if failed == -2:
            raise ValueError("attend_batch: not for this model's heads (see available)")
        if failed:
            raise MemoryError("attend_batch: no memory for a row's scores")
