"""A LoRA adapter (peft's folder: adapter_config.json and adapter_model.safetensors) merged into a model's float32
weights at load, before any int8 conversion: W += (lora_alpha / r) · B·A for every adapted linear layer. The merged
model is a plain model, so every fast path runs it as it runs the base."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
GGUF_FILE = "adapter.gguf"  # the same adapter for llama.cpp (`llama-server --lora`), scripts/adapter_to_gguf.sh
# what trained it: {"command", "stage" (the run's stage it is from), "commit", "protocol" (the one it was tuned for)}
TRAINED_FILE = "trained.json"


class AdapterError(ValueError):
    """An adapter that does not fit the model: one line that says which layer and why."""


@dataclass(frozen=True)
class Adapter:
    """What was merged: the folder, a digest of its weights, and what its card says produced it."""

    folder: Path
    digest: str
    layers: int
    made_by: str  # the training command and commit (TRAINED_FILE; "" where the folder has none)
    protocol: str | None = None  # the protocol it was tuned for (app.protocols), which `auto` then chooses


def merge(model: torch.nn.Module, folder: Path) -> Adapter:
    """Merge the LoRA adapter in `folder` into `model`'s linear weights in place."""
    from safetensors.torch import load

    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("rank_pattern") \
            or config.get("alpha_pattern"):
        raise AdapterError(f"{folder}: only a plain LoRA adapter (one rank, one alpha) is merged at load")
    scale = config["lora_alpha"] / config["r"]
    data = (folder / WEIGHTS_FILE).read_bytes()  # (read once: the weights and their digest)
    state = load(data)
    modules = dict(model.named_modules())
    pairs = 0
    for key in sorted(k for k in state if k.endswith("lora_A.weight")):
        # "base_model.model.<module path>.lora_A.weight" → the module the pair adapts
        path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        layer = modules.get(path)
        if not isinstance(layer, torch.nn.Linear):
            raise AdapterError(f"{folder}: the adapter changes {path}, which is not a linear layer of this model")
        a, b = state[key].float(), state[key.replace("lora_A", "lora_B")].float()
        if (b.shape[0], a.shape[1]) != tuple(layer.weight.shape):
            raise AdapterError(f"{folder}: {path} is {tuple(layer.weight.shape)}, the adapter's is "
                               f"{(b.shape[0], a.shape[1])}")
        with torch.no_grad():
            layer.weight += scale * (b @ a)
        pairs += 1
    if not pairs:
        raise AdapterError(f"{folder}: no LoRA weights in {WEIGHTS_FILE}")
    digest = hashlib.sha256(data).hexdigest()[:12]
    trained = json.loads((folder / TRAINED_FILE).read_text(encoding="utf-8")) if (folder / TRAINED_FILE).exists() \
        else {}
    made_by = " at ".join(str(trained[k]) for k in ("command", "commit") if trained.get(k))
    if trained.get("stage"):
        made_by = f"stage {trained['stage']} of {made_by}"
    return Adapter(folder, digest, pairs, made_by, trained.get("protocol"))
