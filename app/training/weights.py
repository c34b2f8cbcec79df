"""The policy's weights into the engine: an in-place float32 copy into the running model, or a fresh int8 model
quantized from them (docs/training.md measures both)."""

from __future__ import annotations

import copy
import time

import torch

from app.backends.local import LocalBackend
from app.model.loading import wrap

SYNC_MODES = ("float32", "int8")


def trainer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained model's weights, detached, under the names the engine's model uses; a peft model's with its LoRA
    adapter merged in (copies: the adapter is unmerged again)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    model.merge_adapter()
    try:
        return {name.replace(".base_layer", ""): tensor.detach().clone()
                for name, tensor in model.get_base_model().state_dict().items() if "lora_" not in name}
    finally:
        model.unmerge_adapter()


def sync(backend: LocalBackend, policy: torch.nn.Module, mode: str) -> tuple[LocalBackend, float]:
    """The backend that samples from `policy`'s current weights, and the seconds it took: float32 copies them into
    `backend`'s model in place between scheduler steps; int8 quantizes a copy into a new backend and releases the old
    one's scheduler."""
    began = time.perf_counter()
    if mode == "float32":
        backend.load_weights(trainer_weights(policy))
        return backend, time.perf_counter() - began
    if mode != "int8":
        raise ValueError(f"weight sync must be one of {', '.join(SYNC_MODES)} (got {mode!r})")
    model = copy.deepcopy(policy).float()
    fresh = LocalBackend(wrap(model, backend.tokenizer, backend.loaded.name, "int8"))
    backend.scheduler.release()
    return fresh, time.perf_counter() - began
