"""Bad checkpoints and configs fail with a clear error that names the problem.

Each test copies a tiny saved checkpoint, breaks one thing, and checks the error type (a ValueError
subclass) and its message.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jd_testutil import make_hf_model
from jaxdecode.models import CheckpointError, ConfigError, ModelConfig, load_params

VOCAB = 64


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Clean checkpoints to break: a Llama (GQA, untied) and a GPT-2 (tied)."""
    root = tmp_path_factory.mktemp("ckpt")
    for kind in ("llama", "gpt2"):
        make_hf_model(kind, vocab_size=VOCAB).save_pretrained(str(root / kind))
    return root


@pytest.fixture
def llama_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved / "llama", tmp_path / "llama"))


@pytest.fixture
def gpt2_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved / "gpt2", tmp_path / "gpt2"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, edit) -> None:
    """Re-save model.safetensors after `edit(tensors)` changes the dict in place."""
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def test_error_types_are_value_errors():
    assert issubclass(CheckpointError, ValueError) and issubclass(ConfigError, ValueError)


def test_the_clean_checkpoints_load(saved):
    for kind in ("llama", "gpt2"):
        config, _ = load_params(saved / kind)
        assert config.model_type == kind


# ----------------------------------------------------------------------------- config.json
def test_unsupported_architecture(llama_dir):
    edit_config(llama_dir, model_type="bert", architectures=["BertForMaskedLM"])
    with pytest.raises(ConfigError, match=r"unsupported architecture: config.json has "
                                          r"model_type='bert' \(architectures=\['BertForMaskedLM'\]\)"):
        load_params(llama_dir)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     r"unsupported rope_type='yarn'; supported: default, llama3, linear"),
    (dict(hidden_act="gelu"), r"unsupported hidden_act='gelu'"),
    (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    (dict(dtype="int8"), r"unsupported dtype 'int8'"),
])
def test_unsupported_llama_config_values(llama_dir, changes, message):
    edit_config(llama_dir, **changes)
    with pytest.raises(ConfigError, match=message):
        load_params(llama_dir)


@pytest.mark.parametrize("changes, message", [
    (dict(activation_function="relu"), r"unsupported GPT-2 activation_function='relu'"),
    (dict(scale_attn_weights=False), r"scale_attn_weights=false are not supported"),
    (dict(scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_gpt2_options(gpt2_dir, changes, message):
    edit_config(gpt2_dir, **changes)
    with pytest.raises(ConfigError, match=message):
        load_params(gpt2_dir)


def test_requested_dtype_must_be_supported(llama_dir):
    with pytest.raises(ConfigError, match=r"unsupported dtype 'int4'; use float32, bfloat16 or float16"):
        load_params(llama_dir, dtype="int4")


def test_config_sliding_windows_must_match_layers():
    with pytest.raises(ConfigError, match=r"sliding_windows has 3 entries but the model has 2 layers"):
        ModelConfig(model_type="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                    sliding_windows=(4, 4, 4))


# ----------------------------------------------------------------------------- files
def test_directory_without_config_json(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        load_params(llama_dir)


def test_directory_without_safetensors(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no model.safetensors or model.safetensors.index.json"):
        load_params(llama_dir)


def test_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"is not a directory"):
        load_params(tmp_path / "nowhere")


def test_index_naming_a_missing_shard(saved, tmp_path):
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(str(saved / "llama")).save_pretrained(str(tmp_path),
                                                                               max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"lists shard files that do not exist: \['{shards[-1].name}'\]"):
        load_params(tmp_path)


# ----------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight",
                                  "lm_head.weight"])
def test_missing_weight_tensor(llama_dir, name):
    edit_tensors(llama_dir, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing weight tensor '{name}'"):
        load_params(llama_dir)


def test_missing_gpt2_weight_tensor(gpt2_dir):
    edit_tensors(gpt2_dir, lambda t: t.pop("transformer.h.0.attn.c_attn.bias"))
    with pytest.raises(CheckpointError, match=r"missing weight tensor 'transformer.h.0.attn.c_attn.bias'"):
        load_params(gpt2_dir)


def _transpose(name):
    def edit(t):
        t[name] = t[name].T
    return edit


def _truncate_rows(name):
    def edit(t):
        t[name] = t[name][:-1]
    return edit


@pytest.mark.parametrize("edit, message", [
    # Same number of elements, wrong layout: a reshape alone would load it silently.
    (_transpose("model.layers.0.self_attn.k_proj.weight"),
     r"'model.layers.0.self_attn.k_proj.weight' has shape \(32, 16\), expected \(16, 32\)"),
    (_truncate_rows("model.layers.1.mlp.gate_proj.weight"),
     r"'model.layers.1.mlp.gate_proj.weight' has shape \(63, 32\), expected \(64, 32\)"),
    (_truncate_rows("model.embed_tokens.weight"),
     r"'model.embed_tokens.weight' has shape \(63, 32\), expected \(64, 32\)"),
    (_truncate_rows("lm_head.weight"), r"'lm_head.weight' has shape \(63, 32\), expected \(64, 32\)"),
], ids=["k_proj_transposed", "gate_proj", "embed", "lm_head"])
def test_mis_shaped_weight_tensor(llama_dir, edit, message):
    edit_tensors(llama_dir, edit)
    with pytest.raises(CheckpointError, match=message):
        load_params(llama_dir)


def test_mis_shaped_gpt2_weight_tensor(gpt2_dir):
    edit_tensors(gpt2_dir, _transpose("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(CheckpointError,
                       match=r"'transformer.h.1.mlp.c_fc.weight' has shape \(128, 32\), expected \(32, 128\)"):
        load_params(gpt2_dir)


def test_unexpected_weight_tensor(llama_dir):
    edit_tensors(llama_dir, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((64, 32),
                                                                                             np.float32)}))
    with pytest.raises(CheckpointError, match=r"1 weight tensors in .* are not used by a llama model with "
                                              r"this config.json: model.layers.2.mlp.up_proj.weight"):
        load_params(llama_dir)


def test_config_with_fewer_layers_than_the_tensors(llama_dir):
    """A config.json that disagrees with the weights is caught, not half-loaded."""
    edit_config(llama_dir, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"not used by a llama model.*model.layers.1."):
        load_params(llama_dir)
