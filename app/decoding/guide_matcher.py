"""A segment's guide (app.decoding.guide) applied to one tokenizer's tokens by llguidance: the tokens the grammar allows
next, the tokens it forces, and who chose each token."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch

from app.episode import Provenance


class GuideError(ValueError):
    """A grammar the guide cannot use (a bug in the builder or a custom grammar): a clear message, no traceback."""


class GuideVocab:
    """llguidance's view of one tokenizer, built once per model, and the grammars compiled for it (a copy of a compiled
    grammar is far cheaper than a compile)."""

    COMPILED = 64  # grammars kept (each tool output makes one)

    def __init__(self, tokenizer, eos_ids: Iterable[int] = (), lock: threading.RLock | None = None):
        self.size = len(tokenizer)
        eos = sorted(eos_ids) or None  # (None: the tokenizer's own EOS; llguidance refuses an empty list)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.size, eos_token=eos)
        self._hf, self._hf_lock = tokenizer, lock or threading.RLock()  # (the backend's: its tokenizer's lock)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str) -> "GuideMatcher":
        return GuideMatcher(self, grammar)

    def start(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh llguidance matcher for `grammar` (a copy of the compiled one); GuideError where it is bad."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        try:
            lark = llguidance.grammar_from("gbnf", grammar)
        except ValueError as error:  # (a GBNF text that does not parse)
            raise GuideError(f"guide: the grammar does not parse: {error}") from None
        compiled = llguidance.LLMatcher(self.tokenizer, lark, log_level=0)
        if compiled.is_error():
            raise GuideError(f"guide: the guide's grammar: {compiled.get_error()}")
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.COMPILED:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def as_text(self, tokens: list[int]) -> list[int]:
        """`tokens` tokenized as untrusted text is (app.protocols.base.encode), so a special token's text in it stays
        text."""
        if not any(self.tokenizer.is_special_token(t) for t in tokens):
            return tokens  # (llguidance's tokenizer is the model's own: the same ids as encode)
        with self._hf_lock:
            text = self._hf.decode(tokens, skip_special_tokens=False)
            return self._hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def check(self, grammar: str) -> None:
        """Raise GuideError where llguidance rejects the grammar."""
        self.matcher(grammar)


class GuideMatcher:
    """One segment's grammar state: fed every token of the segment in order."""

    def __init__(self, vocab: GuideVocab, grammar: str):
        self._vocab = vocab
        self._matcher = vocab.start(grammar)
        self._bits = llguidance.numpy.allocate_token_bitmask(1, vocab.size)

    def allowed(self) -> np.ndarray:
        """A boolean array over the vocabulary: the tokens the grammar allows next."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bits, 0)
        return self._unpacked()

    def _unpacked(self) -> np.ndarray:
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab.size].view(bool)

    def mask(self, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """One position's logits with the tokens the grammar bans at -inf, and whether the model's first choice
        was banned (the choice made from them is then steered)."""
        allowed = self.allowed()
        n = allowed.shape[0]
        top = int(logits.detach().float().numpy().argmax())
        out = torch.where(torch.from_numpy(allowed), logits[:n], float("-inf"))
        if logits.shape[0] > n:  # (logits past the tokenizer's vocabulary: padding, never a token)
            out = torch.cat([out, logits.new_full((logits.shape[0] - n,), float("-inf"))])
        return out, not (top < n and bool(allowed[top]))

    def greedy(self, logits: torch.Tensor) -> tuple[int, bool]:
        """The greedy choice among the allowed tokens and whether it was steered: the same as greedy(mask(logits)),
        masking the vocabulary only where the model's first choice is banned."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bits, 0)
        raw = logits.detach().float().numpy()
        top = int(raw.argmax())
        if top < self._vocab.size and (int(self._bits[0, top >> 5]) >> (top & 31)) & 1:
            return top, False
        return int(np.where(self._unpacked(), raw[: self._vocab.size], -np.inf).argmax()), True

    def consume(self, tokens: list[int]) -> None:
        """The segment took these tokens (each allowed by the grammar)."""
        if tokens:
            self._matcher.consume_tokens(tokens)
            self._raise_on_error(f"tokens {tokens}")

    @property
    def done(self) -> bool:
        """The grammar is complete: it takes no more tokens."""
        return self._matcher.is_stopped()

    def forced(self) -> list[int]:
        """The tokens of the text the grammar fixes next (none where the model has a choice), tokenized as untrusted
        text and only as many as the grammar takes."""
        forced = self._matcher.compute_ff_tokens()
        tokens = self._vocab.as_text(forced)
        return forced if tokens is forced else tokens[: self._matcher.validate_tokens(tokens)]

    def is_forced(self) -> bool:
        """Whether the grammar fixes the next text (a token taken now is the guide's, whichever spells it)."""
        return bool(self._matcher.compute_ff_bytes())

    def _raise_on_error(self, what: str) -> None:
        if self._matcher.is_error():
            raise GuideError(f"guide: {what}: {self._matcher.get_error()}")


def replay(vocab: GuideVocab, grammar: str, tokens: list[int]) -> list[Provenance]:
    """Who chose each of a model server's tokens, by the same grammar: forced where the grammar fixed the next text,
    else the model's. GuideError where a token breaks the grammar."""
    matcher, out = vocab.matcher(grammar), []
    for token in tokens:
        out.append(Provenance.FORCED if matcher.is_forced() else Provenance.MODEL)
        matcher.consume([token])
    return out
