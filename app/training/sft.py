"""Supervised fine-tuning on this engine's own guided episodes: the loss is on the tokens the model and the guide
wrote after the question (not the question, not tool output), and every example of a batch follows the same system
prompt, whose keys and values are computed once a step without gradient and shared by the batch."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.episode import Episode

IGNORE = -100  # the label the loss skips (torch's cross_entropy ignore_index)
LEARNED = ("model", "steered", "forced")  # who wrote the tokens the loss is on (Episode.provenance)


@dataclass(frozen=True)
class Example:
    """A turn's tokens after the system prompt and their labels (IGNORE where the loss skips a token)."""

    ids: list[int]
    labels: list[int]


def example(episode: Episode) -> Example:
    """The episode's turn as a supervised example: the model's and the guide's tokens are learned, the question and
    tool output are context."""
    labels = [t if who in LEARNED else IGNORE for t, who in zip(episode.token_ids, episode.provenance, strict=True)]
    return Example(list(episode.token_ids), labels)


def batches(examples: list[Example], size: int, seed: int = 0) -> Iterator[list[Example]]:
    """Endless shuffled batches of `size` (a new order each pass)."""
    rng = random.Random(seed)
    order: list[Example] = []
    while True:
        if len(order) < size:
            fresh = list(examples)
            rng.shuffle(fresh)
            order += fresh
        yield order[:size]
        del order[:size]


class SharedPrefixSFT:
    """Optimizer steps of a causal LM on batches whose examples all follow one prompt: `prompt_ids`, or the one a
    step names (another protocol's). TRL's SFTTrainer would run the whole prompt through the forward and backward
    pass for every example; here it runs once a step, without gradient (docs/training.md measures both)."""

    def __init__(self, model: torch.nn.Module, prompt_ids: list[int], learning_rate: float, pad_id: int,
                 max_grad_norm: float = 1.0):
        self.model, self.prompt, self.pad_id, self.max_grad_norm = model, torch.tensor([prompt_ids]), pad_id, \
            max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=learning_rate, weight_decay=0.0)

    def loss(self, batch: list[Example], prompt_ids: list[int] | None = None) -> torch.Tensor:
        """Mean cross-entropy over the batch's labelled tokens, each example after the shared prompt."""
        prompt = self.prompt if prompt_ids is None else torch.tensor([prompt_ids])
        with torch.no_grad():
            cache = self.model(input_ids=prompt, use_cache=True).cache
        cache.batch_repeat_interleave(len(batch))
        width = max(len(e.ids) for e in batch)
        ids = torch.tensor([e.ids + [self.pad_id] * (width - len(e.ids)) for e in batch])
        labels = torch.tensor([e.labels + [IGNORE] * (width - len(e.labels)) for e in batch])
        real = torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in batch])
        mask = torch.cat([torch.ones(len(batch), prompt.shape[1], dtype=torch.long), real], dim=1)
        logits = self.model(input_ids=ids, cache=cache, attention_mask=mask).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=IGNORE)

    def step(self, batch: list[Example], prompt_ids: list[int] | None = None) -> float:
        """One optimizer step on the batch (after `prompt_ids`, else the prompt given at the start); its loss."""
        self.model.train()
        loss = self.loss(batch, prompt_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)
