"""The LoRA adapter merged at load (app.model.adapter, app.model.loading): the merge equals peft's, a misfit adapter
is refused by name, ADAPTER chooses base or adapter, and the shipped adapter changes what the bundled model does."""

from __future__ import annotations

import json

import pytest
import torch

from app.model.adapter import TRAINED_FILE, AdapterError, merge
from app.model.int8 import SAVED_INT8
from app.model.loading import BUNDLED_ADAPTER, ModelUnavailable, adapter_choice, wrap

peft = pytest.importorskip("peft")


def tiny_model(hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def saved_adapter(tmp_path, hidden: int = 32):
    """A peft LoRA on a tiny llama with random (non-zero) B, saved; the peft model beside it."""
    model = peft.get_peft_model(tiny_model(hidden), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(tmp_path))
    return model


def test_the_merged_model_computes_what_peft_computes(tmp_path):
    lora = saved_adapter(tmp_path).eval()
    plain = tiny_model()
    adapter = merge(plain, tmp_path)
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, lora(ids).logits, atol=1e-5)
    assert adapter.layers == 3 * 2 and len(adapter.digest) == 12
    assert not torch.allclose(tiny_model()(ids).logits, plain(ids).logits, atol=1e-3)  # (the merge changed it)


def test_an_adapter_for_another_shape_is_refused_by_layer(tmp_path):
    saved_adapter(tmp_path, hidden=48)
    with pytest.raises(AdapterError, match=r"down_proj is \(32, 64\), the adapter.s is \(48, 64\)"):
        merge(tiny_model(), tmp_path)


def test_an_adapter_of_another_kind_is_refused(tmp_path):
    saved_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="only a plain LoRA"):
        merge(tiny_model(), tmp_path)


@pytest.mark.parametrize("value, bundled, expected", [
    ("", True, BUNDLED_ADAPTER), ("off", True, None), ("on", True, BUNDLED_ADAPTER), ("ON", True, BUNDLED_ADAPTER),
    ("", False, None), ("off", False, None)])
def test_adapter_choice(monkeypatch, value, bundled, expected):
    monkeypatch.setenv("ADAPTER", value)
    assert adapter_choice(bundled) == expected


def test_the_shipped_adapter_is_never_merged_into_a_model_id_model(monkeypatch):
    monkeypatch.setenv("ADAPTER", "on")
    with pytest.raises(ModelUnavailable, match="MODEL_ID replaces"):
        adapter_choice(False)


def test_an_adapter_folder_is_taken_even_for_a_model_id_and_a_wrong_one_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTER", str(tmp_path))
    with pytest.raises(ModelUnavailable, match="no adapter_config.json"):
        adapter_choice(False)
    saved_adapter(tmp_path)
    assert adapter_choice(False) == tmp_path


def test_wrap_merges_before_int8_and_keys_the_int8_file_by_the_adapter(tmp_path, tokenizer):
    saved_adapter(tmp_path / "adapter")
    (tmp_path / "cache").mkdir()
    base = wrap(tiny_model(), tokenizer, "tiny", "float32")
    adapted = wrap(tiny_model(), tokenizer, "tiny", "float32", adapter=tmp_path / "adapter")
    assert base.adapter is None and adapted.adapter is not None
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        assert not torch.allclose(base.model(ids).logits, adapted.model(ids).logits, atol=1e-3)
    int8 = wrap(tiny_model(), tokenizer, "tiny", "int8", tmp_path / "cache", adapter=tmp_path / "adapter")
    assert int8.weights == "int8"
    assert (tmp_path / "cache" / f"{int8.adapter.digest}-{SAVED_INT8}").exists()  # (never the base's file)
    assert not (tmp_path / "cache" / SAVED_INT8).exists()


def test_auto_chooses_the_protocol_the_adapter_was_tuned_for(tmp_path, tokenizer):
    from app.backends.local import LocalBackend
    from app.engine.engine import Engine

    saved_adapter(tmp_path)
    (tmp_path / TRAINED_FILE).write_text(json.dumps({"command": "python3 scripts/train.py", "commit": "abc1234",
                                                     "protocol": "chat"}))
    tuned = LocalBackend(wrap(tiny_model_for(tokenizer), tokenizer, "tiny", adapter=tmp_path))
    base = LocalBackend(wrap(tiny_model_for(tokenizer), tokenizer, "tiny"))
    assert tuned.loaded.adapter.made_by == "python3 scripts/train.py at abc1234"
    assert tuned.tuned_for == "chat" and base.tuned_for is None
    assert Engine(tuned, protocol="auto").protocol.name == "chat"
    assert Engine(base, protocol="auto").protocol.name == "textenv"  # (the bundled template renders no tools)
    assert "+ adapter" in tuned.name and tuned.stats().adapter.endswith("trained by python3 scripts/train.py at "
                                                                         "abc1234")
    assert base.stats().adapter is None


def tiny_model_for(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
