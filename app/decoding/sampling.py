"""Which token comes next: greedy or nucleus sampling, and prompt-lookup drafts that greedy decoding verifies."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PromptLookup:
    """Draft tokens for greedy decoding by prompt lookup: what followed the latest earlier occurrence of the session's
    last 3 (else 2) tokens. Small models copy a lot, one pass verifies a whole draft, and only drafts equal to the
    model's own greedy choices are kept, so the output does not change."""

    def __init__(self, ids: list[int], max_ngram: int = 3, min_ngram: int = 2):
        self._ids = ids  # the session's live list: grows as tokens are accepted
        self._sizes = range(max_ngram, min_ngram - 1, -1)
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 1
        self.sync()

    def sync(self) -> None:
        """Index every position whose continuation is known (all but the last token), each n-gram keeping its latest."""
        ids, end = self._ids, len(self._ids)
        for n in self._sizes:
            lo = max(self._indexed, n)
            if lo < end:
                grams = zip(*(ids[lo - n + j:end - n + j] for j in range(n)))
                self._after.update(zip(grams, range(lo, end)))
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        ids, end = self._ids, len(self._ids)
        for n in self._sizes:
            at = self._after.get(tuple(ids[end - n:end]))
            if at is not None:
                return ids[at:at + k]
        return []


def greedy(logits: torch.Tensor) -> int:
    """The largest logit's index (the first on a tie), as torch.argmax, by NumPy's faster argmax."""
    return int(logits.detach().float().numpy().argmax())  # (float(): a bfloat16 model's logits too)


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
               top_k: int = 0) -> int:
    """Greedy at temperature 0, else sampling from the k most likely tokens (top_k > 0), then from the nucleus
    (top_p < 1), in transformers' order."""
    import torch  # here, not at the top: Stop and the other records here are imported by the light CLI commands

    if temperature <= 0:
        return greedy(logits)
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # (ties with the k-th stay, as in transformers)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float) -> list[float]:
    """log p(token) for tokens[i] under logits[i], as a trainer recomputes them: a log-softmax of the logits over the
    temperature (1 when greedy), over the whole vocabulary."""
    import torch

    rows = logits[: len(tokens)].float()
    if temperature > 0:
        rows = rows / temperature
    picked = torch.tensor(tokens, dtype=torch.long).unsqueeze(-1)
    return torch.log_softmax(rows, dim=-1).gather(-1, picked).squeeze(-1).tolist()
