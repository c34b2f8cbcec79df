"""The one owner of a session's token ids and of the KV cache over a prefix of them. Invariant, checked before every
pass: the cache holds exactly `ids[:cached]`, with `cached < len(ids)`; anything else gives wrong logits silently, so
nothing else touches the cache. A session may read the engine's system-prompt cache as a read-only prefix
(`fork(share=True)`) instead of copying it."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# A layer's storage grows by this much room at a time; also the KV budget's grain (docs/architecture.md).
GROW_TOKENS = 32


def room_for(tokens: int) -> int:
    """Positions a layer's storage has room for once it holds `tokens` (GrowingLayer.reserve's growth)."""
    return (tokens // GROW_TOKENS + 1) * GROW_TOKENS


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in storage with spare room, written in place, so a step writes only its new
    positions. `keys`/`values` are views made when read; assigning anything else turns it back into a plain DynamicLayer
    until it next grows."""

    _storage: tuple[torch.Tensor, torch.Tensor] | None = None
    _length = 0  # positions held, while the layer lives in _storage
    _PLAIN = ("_keys", "_values")  # where a plain layer keeps its tensors

    def _get(self, part: int) -> torch.Tensor | None:
        if self._storage is not None:
            return self._storage[part][..., : self._length, :]
        return self.__dict__.get(self._PLAIN[part])

    def _set(self, part: int, value: torch.Tensor | None) -> None:
        storage = self._storage
        if storage is not None:
            held = storage[part]
            if value is not None and value.data_ptr() == held.data_ptr() and value.stride() == held.stride() \
                    and value.shape[:-2] == held.shape[:-2] and value.shape[-1] == held.shape[-1]:
                self._length = value.shape[-2]  # a view of the storage's start (transformers' crop)
                return
            self.__dict__["_keys"], self.__dict__["_values"] = self.keys, self.values  # plain tensors from here
            self._storage = None
        self.__dict__[self._PLAIN[part]] = value

    keys = property(lambda self: self._get(0), lambda self, value: self._set(0, value))
    values = property(lambda self: self._get(1), lambda self, value: self._set(1, value))

    @property
    def room(self) -> int:
        """Positions its storage has room for (0 while it is a plain layer, its tensors outside any storage)."""
        return self._storage[0].shape[-2] if self._storage is not None else 0

    def get_seq_length(self) -> int:
        return self._length if self._storage is not None else super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        if self._storage is None or tokens_to_remove > 0:
            super().crop(tokens_to_remove)  # (a positive count: transformers' error)
        else:
            self._length = max(0, self._length - abs(tokens_to_remove))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values, n = self.reserve(key_states, value_states)
        end = n + key_states.shape[-2]
        keys[..., n:end, :], values[..., n:end, :] = key_states, value_states
        return self.keys, self.values

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor,
                count: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for `count` positions (default: key_states') after the n held: (key storage, value storage, n). The
        layer covers the new positions at once, so the caller writes them before anything reads it."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        need = n + (key_states.shape[-2] if count is None else count)
        if self._storage is None or need > self._storage[0].shape[-2]:
            room = room_for(need)
            grown = tuple(s.new_empty((*s.shape[:-2], room, s.shape[-1])) for s in (key_states, value_states))
            if n:
                grown[0][..., :n, :], grown[1][..., :n, :] = self.keys, self.values
            self._storage = grown
        self._length = need
        keys, values = self._storage
        return keys, values, n


def new_kv(config) -> DynamicCache:
    """A DynamicCache whose full-attention layers grow in place."""
    kv = DynamicCache(config=config)
    kv.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in kv.layers]
    return kv


def kv_nbytes(kv: DynamicCache | None) -> int:
    """Bytes of a cache's key/value storage, spare room included."""
    if kv is None:
        return 0
    return sum(t.untyped_storage().nbytes() for layer in kv.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


class CacheInvariantError(AssertionError):
    """The KV cache no longer covers a prefix of the session's ids (a bug, never a user error)."""


class TokenCache:
    """Token ids (the ground truth) plus a DynamicCache over a prefix of them."""

    def __init__(self, ids: list[int] | None = None):
        self._ids: list[int] = list(ids or [])
        self._kv: DynamicCache | None = None  # this session's own keys/values, after the shared prefix's
        self._kv_ids: list[int] = []  # the ids the cache was computed from (the prefix's too), to check the prefix
        self._prefix: DynamicCache | None = None  # a shared, read-only cache of ids[:shared] (another TokenCache's)

    @property
    def ids(self) -> list[int]:
        """The session's tokens. Read-only by convention: change them through extend/truncate."""
        return self._ids

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def cached(self) -> int:
        return len(self._kv_ids)

    @property
    def prefix(self) -> DynamicCache | None:
        """The shared prefix's keys/values (read-only), or None when this cache holds all of its own."""
        return self._prefix

    @property
    def own_kv(self) -> DynamicCache | None:
        """This cache's own keys/values (read-only here): what a fork(share=True) reads as its prefix."""
        return self._kv

    @property
    def shared(self) -> int:
        """How many of the cached positions the shared prefix holds."""
        return self._prefix.get_seq_length() if self._prefix is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes of key/value tensors this session holds (its own: a shared prefix is counted by its owner)."""
        return kv_nbytes(self._kv)  # (read once: another thread may drop it meanwhile, e.g. for a stats panel)

    def extend(self, ids: list[int]) -> None:
        self._ids.extend(ids)

    def truncate(self, length: int) -> None:
        """Keep ids[:length] and crop the cache to match (used when a turn is rolled back)."""
        del self._ids[length:]
        self._crop(length)

    def drop_kv(self) -> None:
        """Free the keys/values but keep the ids; the next forward pass recomputes them."""
        self._kv, self._kv_ids, self._prefix = None, [], None

    def fork(self, share: bool = False) -> "TokenCache":
        """An independent copy (a shared prefix stays shared). With `share`, the copy reads this cache's keys/values as
        its prefix, which must then never change."""
        other = TokenCache(self._ids)
        if share and self._prefix is None and self._kv is not None and self.cached == len(self._ids):
            other._prefix = self._kv
        else:
            other._kv, other._prefix = copy.deepcopy(self._kv), self._prefix
        other._kv_ids = list(self._kv_ids)
        return other

    def reuse(self, prefix: "TokenCache", share: bool = False) -> bool:
        """For an evicted session whose ids start with `prefix`'s cached ids: copy those (or, with `share`, read them in
        place) instead of recomputing them; whether it did."""
        n = prefix.cached
        if self._kv is not None or self._prefix is not None or not n or n >= len(self._ids) \
                or self._ids[:n] != prefix._kv_ids:
            return False
        linked = prefix.fork(share=share)
        self._kv, self._prefix, self._kv_ids = linked._kv, linked._prefix, linked._kv_ids
        return True

    def pending(self, config) -> tuple[DynamicCache, int, list[int]]:
        """Before a forward pass: (the cache to extend, how many ids it covers, the uncached ids to feed).

        A fully cached sequence gives up its last cached position, so there is always a token to feed.
        """
        if self.cached >= len(self._ids):
            self._crop(len(self._ids) - 1)
        self.check()
        if self._kv is None:
            self._kv = new_kv(config)
        return self._kv, self.cached, self._ids[self.cached:]

    def advance(self, n: int) -> None:
        """After a pass that fed the next `n` uncached ids into every layer of the cache."""
        self._kv_ids.extend(self._ids[self.cached:self.cached + n])
        if self._kv is None or self._held() != len(self._kv_ids):
            raise CacheInvariantError(f"cache holds {self._held()} positions, expected {len(self._kv_ids)}")

    def _held(self) -> int:
        """Positions the keys/values cover: the shared prefix's and the session's own."""
        return self.shared + (self._kv.get_seq_length() if self._kv is not None else 0)

    def rollback(self) -> None:
        """After a failed pass: drop whatever keys/values it added in any layer (some layers may hold the new
        positions, others not), so the cache covers exactly the ids it covered before the pass."""
        if self._kv is None:
            return
        own = self.cached - self.shared
        for layer in self._kv.layers:
            extra = layer.get_seq_length() - own if layer.is_initialized else 0
            if extra > 0:
                layer.crop(-extra)
        self.check()

    def forward(self, model, keep: int = 1) -> tuple[torch.Tensor, int, int]:
        """Feed the uncached ids through the model alone; return (logits of the last `keep` positions, fed, reused)."""
        self._own_the_prefix(model.config)  # the model's own forward reads one ordinary cache
        kv, reused, new = self.pending(model.config)
        try:
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([new]), cache=kv, use_cache=True, logits_to_keep=keep)
        except BaseException:
            self.drop_kv()  # some layers may hold the new positions already: recompute rather than trust them
            raise
        self.advance(len(new))
        return out.logits[0, -keep:], len(new), reused

    def check(self) -> None:
        """Raise if the cache does not cover an exact, strict prefix of the ids."""
        n = len(self._kv_ids)
        kv_len = self._held()
        if kv_len != n or n >= len(self._ids) or self._ids[:n] != self._kv_ids:
            raise CacheInvariantError(f"cache covers {kv_len} positions / {n} ids, session has {len(self._ids)} ids")

    def _own_the_prefix(self, config) -> None:
        """Copy the shared prefix's keys/values in front of the session's own, into one cache of its own."""
        if self._prefix is None:
            return
        joined = new_kv(config)
        for index, layer in enumerate(self._prefix.layers):
            keys, values = layer.keys, layer.values
            own = self._kv.layers[index] if self._kv is not None else None
            if own is not None and own.is_initialized:
                keys, values = torch.cat([keys, own.keys], dim=-2), torch.cat([values, own.values], dim=-2)
            joined.update(keys, values, index)  # (copied into the new storage)
        self._kv, self._prefix = joined, None

    def _crop(self, length: int) -> None:
        if length >= self.cached:
            return
        if length <= 0 or length < self.shared or (self._kv is None and self._prefix is None):
            self.drop_kv()  # (cut into the shared prefix: the next turn links or recomputes it whole)
            return
        if self._kv is not None:
            self._kv.crop(length - self.cached)  # transformers 5 accepts only a negative count here
        del self._kv_ids[length:]
