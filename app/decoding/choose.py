"""The tokens one pass adds to a segment: the drafts the model agrees with, then its own next token, each chosen
from the pass's logits as the guide masks them, with who chose each (app.episode.Provenance)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.decoding.sampling import greedy, next_token
from app.episode import Provenance

if TYPE_CHECKING:
    import torch

    from app.decoding.guide_matcher import GuideMatcher


def choose_tokens(logits: torch.Tensor, drafts: list[int], temperature: float, top_p: float,
                  generator: torch.Generator | None, guide: GuideMatcher | None,
                  top_k: int = 0) -> tuple[list[int], list[Provenance]]:
    """`logits` holds one row per draft plus one. Drafts never change what is chosen: a draft is kept only while it
    equals the choice at its position. The guide takes each token as it is chosen."""
    tokens, chosen_by = [], []
    for i in range(len(drafts) + 1):
        fixed = guide is not None and guide.is_forced()  # the grammar fixes the next text (its last token, which
        # could merge with what follows, is left to a pass: whichever token spells it, the text is the guide's)
        if guide is None:
            pick = greedy(logits[i]) if drafts else next_token(logits[i], temperature, top_p, generator, top_k)
            steered = False
        elif drafts or temperature <= 0:
            pick, steered = guide.greedy(logits[i])
        else:
            row, steered = guide.mask(logits[i])
            pick = next_token(row, temperature, top_p, generator, top_k)
        tokens.append(pick)
        chosen_by.append(Provenance.FORCED if fixed else Provenance.STEERED if steered else Provenance.MODEL)
        if guide is not None:
            guide.consume([pick])
        if i == len(drafts) or pick != drafts[i] or (guide is not None and (guide.done or guide.is_forced())):
            break  # (text the grammar fixes is the guide's, drafted or not: the next pass forces it)
    return tokens, chosen_by
