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
    """Clean checkpoints to break: a Llama (GQA, untied), a GPT-2 (tied) and a Gemma 3."""
    root = tmp_path_factory.mktemp("ckpt")
    for kind in ("llama", "gpt2", "gemma3_text"):
        make_hf_model(kind, vocab_size=VOCAB).save_pretrained(str(root / kind))
    return root


@pytest.fixture
def llama_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved / "llama", tmp_path / "llama"))


@pytest.fixture
def gemma3_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved / "gemma3_text", tmp_path / "gemma3_text"))


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
    for kind in ("llama", "gpt2", "gemma3_text"):
        config, _ = load_params(saved / kind)
        assert config.model_type == kind


# ----------------------------------------------------------------------------- config.json
def test_unsupported_architecture(llama_dir):
    edit_config(llama_dir, model_type="bert", architectures=["BertForMaskedLM"])
    with pytest.raises(ConfigError, match=r"unsupported architecture: config.json has "
                                          r"model_type='bert' \(architectures=\['BertForMaskedLM'\]\)"):
        load_params(llama_dir)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
     r"unsupported rope_type='dynamic'; supported: default, llama3, linear, yarn"),
    (dict(hidden_act="relu"), r"unsupported hidden_act='relu'; the gated MLP implements \['gelu', "
                              r"'gelu_pytorch_tanh', 'silu'\]"),
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


@pytest.mark.parametrize("changes, message", [
    (dict(final_logit_softcapping=-30.0), r"final_logit_softcapping=-30.0: soft-capping takes a positive number"),
    (dict(attn_logit_softcapping="50"), r"attn_logit_softcapping='50'"),
    (dict(model_type="gemma", attn_logit_softcapping=50.0), r"unsupported gemma option attn_logit_softcapping=50.0:"
                                                           r" soft-capping takes a positive number, in a Gemma 2"),
    (dict(use_bidirectional_attention=True), r"EmbeddingGemma, an encoder"),
    (dict(sliding_window=None), r"has sliding-attention layers but sliding_window is None"),
    (dict(layer_types=["full_attention"]), r"layer_types has 1 entries for 2 layers"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     r"unsupported rope_type='linear' for Gemma 3's sliding-window layers"),
    (dict(hidden_activation="relu"), r"unsupported hidden_act='relu'"),
])
def test_unsupported_gemma3_options(gemma3_dir, changes, message):
    edit_config(gemma3_dir, **changes)
    with pytest.raises(ConfigError, match=message):
        load_params(gemma3_dir)


@pytest.mark.parametrize("model_type, head_dim", [("llama", 8), ("qwen3", 128), ("gemma", 256), ("gemma2", 256),
                                                   ("gemma3_text", 256)])
def test_head_dim_defaults_as_transformers(model_type, head_dim):
    """A config.json without head_dim: hidden / heads for Llama, the class default for Qwen3 and Gemma."""
    cfg = dict(model_type=model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    assert ModelConfig.from_hf_dict(cfg).head_dim == head_dim


@pytest.mark.parametrize("rope, want", [
    ({"rope_type": "yarn", "factor": 4.0}, {"factor": 4.0, "original_max_position_embeddings": 512}),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},  # DeepSeek-V3's form
     {"factor": 4.0, "original_max_position_embeddings": 128}),
    ({"rope_type": "llama3", "factor": 8.0}, {"factor": 8.0, "original_max_position_embeddings": 512}),
])
def test_rope_scaling_defaults_as_transformers(rope, want):
    """The pretraining length defaults to max_position_embeddings, and YaRN's factor to the ratio."""
    from jaxdecode.models.config import rope_attention_factor
    cfg = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rope_parameters=dict(rope, rope_theta=10000.0))
    config = ModelConfig.from_hf_dict(cfg)
    assert dict(config.rope_scaling) == dict(want, rope_type=rope["rope_type"])
    want_factor = 0.1 * np.log(4.0) + 1 if rope["rope_type"] == "yarn" else 1.0
    assert rope_attention_factor(config) == pytest.approx(want_factor)


@pytest.mark.parametrize("changes, message", [
    (dict(decoder_sparse_step=2), r"has dense MLP layers \(decoder_sparse_step=2, mlp_only_layers=\[\]\)"),
    (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]\); jaxdecode loads mixture-of-experts models whose every"),
    (dict(num_experts_per_tok=5), r"a mixture of 4 experts needs 1 <= num_experts_per_tok <= 4 \(got 5\)"),
])
def test_unsupported_moe_configs(changes, message):
    cfg = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16)
    assert ModelConfig.from_hf_dict(cfg).num_experts == 4
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(cfg, **changes))


@pytest.mark.parametrize("model_type, want", [
    ("gemma2", dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    ("mixtral", dict(rope_theta=1e6, norm_eps=1e-5)),
    ("smollm3", dict(rope_theta=2e6, tie_word_embeddings=True)),
    # Granite's attention scale is attention_multiplier, 1.0 by default (not head_dim ** -0.5)
    ("granite", dict(attention_multiplier=1.0, attn_scale=1.0, embedding_multiplier=1.0, logits_scaling=1.0,
                     norm_eps=1e-6, tie_word_embeddings=False)),
    ("qwen2_moe", dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, moe_norm_topk=False,
                       shared_expert_intermediate_size=5632, qkv_bias=True, o_bias=False,
                       max_position_embeddings=32768)),
    ("olmoe", dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=64, moe_norm_topk=False, norm_eps=1e-5,
                   clip_qkv=None, qk_norm_full=True)),
    # Command-R's RoPE base is 500000 (its class's default_theta), its LayerNorms' eps layer_norm_eps, tied
    ("cohere", dict(logit_scale=0.0625, norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True, qk_norm=False,
                    parallel_block=True, norm_center=True, sliding_windows=(0, 0), rope_layers=())),
    # Command R7B: three sliding layers of four (here both of 2), window 4096, RoPE base 10000
    ("cohere2", dict(logit_scale=0.0625, norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True, qk_norm=False,
                     sliding_windows=(4096, 4096), rope_layers=(1, 1))),
    # Granite-MoE: 8 experts of intermediate_size, 2 per token, the softmax over the top 2 (renormalised)
    ("granitemoe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, moe_norm_topk=True,
                        attn_scale=1.0, shared_expert_intermediate_size=0, norm_eps=1e-6)),
    # its shared variant's class default is no shared MLP (shared_intermediate_size 0)
    ("granitemoeshared", dict(num_experts=8, shared_expert_intermediate_size=0, shared_expert_gated=False)),
    # Phi-3.5-MoE: 16 experts, sparsemixer at jitter_eps 0.01, LayerNorms of eps 1e-5, rope_theta 1e6, no biases
    ("phimoe", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64, moe_norm_topk=False,
                    sparsemixer_eps=0.01, layer_norm=True, norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
                    qkv_bias=False, lm_head_bias=False, sliding_windows=(0, 0))),
])
def test_keys_left_out_take_the_familys_transformers_defaults(model_type, want):
    """A config.json without these keys is read as transformers reads it: its config class's values."""
    cfg = dict(model_type=model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=0, eos_token_id=1,
               pad_token_id=0)
    config = ModelConfig.from_hf_dict(cfg)
    assert {k: getattr(config, k) for k in want} == want


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), r"rope_type='linear' needs a positive 'factor'"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 0, "rope_theta": 1e4}), r"needs a positive 'factor'.*0"),
    (dict(layer_types=["full_attention", "chunked_attention"]), r"layer_types has \['chunked_attention'\]"),
])
def test_bad_rope_and_layer_types_are_refused_at_load(changes, message):
    cfg = dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(cfg, **changes))


GRANITE = dict(model_type="granite", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
QWEN2_MOE = dict(GRANITE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 shared_expert_intermediate_size=24)
OLMOE = dict(GRANITE, model_type="olmoe", num_experts=4, num_experts_per_tok=2)
GRANITEMOE = dict(GRANITE, model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2)
PHIMOE = dict(GRANITE, model_type="phimoe", num_local_experts=4, max_position_embeddings=128)
PHIMOE_ROPE = dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4, short_mscale=1.2,
                   long_mscale=1.3, original_max_position_embeddings=16, rope_theta=1e4)


@pytest.mark.parametrize("cfg, message", [
    (dict(GRANITE, embedding_multiplier=None), r"unsupported granite embedding_multiplier=None; it takes a finite"),
    (dict(GRANITE, logits_scaling=0), r"unsupported granite logits_scaling=0; it takes a finite number other than 0"),
    (dict(GRANITE, attention_multiplier="1/128"), r"unsupported granite attention_multiplier='1/128'"),
    (dict(QWEN2_MOE, decoder_sparse_step=2), r"qwen2_moe config.json has dense MLP layers \(decoder_sparse_step=2"),
    (dict(QWEN2_MOE, mlp_only_layers=[1]), r"mlp_only_layers=\[1\]\); jaxdecode loads mixture-of-experts models"),
    (dict(QWEN2_MOE, num_experts=0), r"dense MLP layers \(num_experts=0\); jaxdecode loads mixture-of-experts"),
    (dict(QWEN2_MOE, shared_expert_intermediate_size=0), r"unsupported qwen2_moe shared_expert_intermediate_size=0"),
    (dict(QWEN2_MOE, layer_types=["sliding_attention", "full_attention"]),
     r"layer_types has sliding-attention layers but use_sliding_window is false"),
    (dict(QWEN2_MOE, use_sliding_window=True, sliding_window=None),
     r"sets use_sliding_window but sliding_window is None"),
    (dict(OLMOE, clip_qkv=-1.0), r"unsupported olmoe clip_qkv=-1.0; it takes a positive number \(or null"),
    (dict(OLMOE, head_dim=16), r"unsupported olmoe head_dim=16: transformers' OLMoE norms the queries over "
                               r"hidden_size \(32\), so its head_dim is hidden_size // num_attention_heads \(8\)"),
    (dict(OLMOE, sliding_window=4), r"unsupported olmoe sliding_window=4: transformers' OLMoE windows its attention "
                                    r"on its flash-attention path only"),
    (dict(OLMOE, num_experts=0), r"this olmoe config.json has num_experts=0"),
    (dict(OLMOE, num_experts_per_tok=5), r"a mixture of 4 experts needs 1 <= num_experts_per_tok <= 4 \(got 5\)"),
    (dict(GRANITEMOE, num_local_experts=0), r"unsupported granitemoe num_local_experts=0; jaxdecode loads Granite-MoE"),
    (dict(GRANITEMOE, logits_scaling=0), r"unsupported granitemoe logits_scaling=0; it takes a finite number other"),
    (dict(GRANITEMOE, model_type="granitemoeshared", shared_intermediate_size=-8),
     r"unsupported granitemoeshared shared_intermediate_size=-8; it takes a width >= 0"),
    (dict(PHIMOE, num_experts_per_tok=1), r"unsupported phimoe num_experts_per_tok=1: transformers' sparsemixer"),
    (dict(PHIMOE, router_jitter_noise=-0.1), r"unsupported phimoe router_jitter_noise=-0.1; it takes a number >= 0"),
    (dict(PHIMOE, rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4)),
     r"unsupported rope_type='yarn' for phimoe; supported: default, longrope"),
    (dict(PHIMOE, rope_parameters={k: v for k, v in PHIMOE_ROPE.items() if k != "long_mscale"}),
     r"phimoe's longrope needs long_mscale, a number"),
    (dict(PHIMOE, rope_parameters=dict(PHIMOE_ROPE, attention_factor=1.1)),
     r"unsupported phimoe longrope keys \['attention_factor'\]"),
    (dict(PHIMOE, rope_parameters=PHIMOE_ROPE, original_max_position_embeddings=32),
     r"original_max_position_embeddings=32 at the top level but 16 in its rope scaling"),
    (dict(PHIMOE, rope_parameters=dict(PHIMOE_ROPE, partial_rotary_factor=0.5)),
     r"unsupported phimoe partial_rotary_factor=0.5: Phi-3.5-MoE rotates whole heads"),
])
def test_unsupported_granite_and_moe_options_are_refused_at_load(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(cfg)


def test_granite_and_moe_configs_read_as_transformers_reads_them():
    """Qwen2-MoE reads its q/k/v biases from qkv_bias (attention_bias means nothing there) and, with
    use_sliding_window, windows the layers layer_types names (by default the even ones below max_window_layers,
    as transformers 5); Granite reads no window, OLMoE its experts' width from intermediate_size."""
    c = ModelConfig.from_hf_dict(dict(QWEN2_MOE, attention_bias=False))
    assert (c.qkv_bias, c.o_bias) == (True, False)
    assert not ModelConfig.from_hf_dict(dict(QWEN2_MOE, qkv_bias=False, attention_bias=True)).qkv_bias
    c = ModelConfig.from_hf_dict(dict(QWEN2_MOE, num_hidden_layers=6, use_sliding_window=True, sliding_window=8,
                                      max_window_layers=4))
    assert c.sliding_windows == (8, 0, 8, 0, 0, 0)
    c = ModelConfig.from_hf_dict(dict(QWEN2_MOE, use_sliding_window=True, sliding_window=8,
                                      layer_types=["full_attention", "sliding_attention"]))
    assert c.sliding_windows == (0, 8)
    assert ModelConfig.from_hf_dict(dict(QWEN2_MOE, sliding_window=8)).sliding_windows == (0, 0)
    assert ModelConfig.from_hf_dict(dict(GRANITE, sliding_window=4)).sliding_windows == (0, 0)
    c = ModelConfig.from_hf_dict(dict(OLMOE, intermediate_size=48, moe_intermediate_size=16, num_local_experts=8,
                                      num_experts=None))
    assert (c.moe_intermediate_size, c.num_experts) == (48, 8)


def test_granite_moe_configs_read_and_write_as_transformers():
    """Granite-MoE reads no window and renormalises its top k whatever norm_topk_prob says (a key it lacks);
    Granite-MoE-shared without a shared MLP (shared_intermediate_size 0, its class default) loads and saves so."""
    c = ModelConfig.from_hf_dict(dict(GRANITEMOE, sliding_window=4, norm_topk_prob=False, intermediate_size=48))
    assert (c.sliding_windows, c.moe_norm_topk, c.moe_intermediate_size, c.num_experts) == ((0, 0), True, 48, 4)
    for cfg in (GRANITEMOE, dict(GRANITEMOE, model_type="granitemoeshared", shared_intermediate_size=0),
                dict(GRANITEMOE, model_type="granitemoeshared", shared_intermediate_size=24)):
        c = ModelConfig.from_hf_dict(cfg)
        assert c.shared_expert_intermediate_size == cfg.get("shared_intermediate_size", 0)
        assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_phimoe_configs_read_and_write_as_transformers():
    """Phi-3.5-MoE's longrope in the released 4.x form ("type", the pretraining length in both places) and the
    5.x form read alike; without its own length the rope scaling takes max_position_embeddings, as transformers 5;
    a window over every layer; saved and read back the same."""
    released = dict(PHIMOE, rope_theta=1e4, original_max_position_embeddings=16, sliding_window=8, rope_scaling={
        "type": "longrope", **{k: v for k, v in PHIMOE_ROPE.items() if k not in ("rope_type", "rope_theta")}})
    c = ModelConfig.from_hf_dict(released)
    assert c == ModelConfig.from_hf_dict(dict(PHIMOE, rope_parameters=PHIMOE_ROPE, sliding_window=8))
    assert (dict(c.rope_scaling)["original_max_position_embeddings"], c.sliding_windows) == (16, (8, 8))
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    rope = {k: v for k, v in PHIMOE_ROPE.items() if k != "original_max_position_embeddings"}
    c = ModelConfig.from_hf_dict(dict(PHIMOE, rope_parameters=rope))
    assert dict(c.rope_scaling)["original_max_position_embeddings"] == 128


def test_granite_and_moe_networks_a_layout_cannot_say_are_not_saved():
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    olmoe = dict(qk_norm=True, qk_norm_full=True, **moe)
    phi3_rope = (("long_factor", (2.0,) * 4), ("original_max_position_embeddings", 16), ("rope_type", "longrope"),
                 ("short_factor", (1.0,) * 4))
    phimoe_rope = tuple(sorted(phi3_rope + (("long_mscale", 1.3), ("short_mscale", 1.2))))
    for cfg, match in [
            (ModelConfig(model_type="llama", embedding_multiplier=2.0, **base),
             r"a llama config.json cannot express embedding_multiplier=2.0 \(Granite alone has it\)"),
            (ModelConfig(model_type="llama", logits_scaling=4.0, **base), r"logits_scaling=4.0 \(Granite alone"),
            (ModelConfig(model_type="llama", attention_multiplier=0.5, **base),
             r"attention_multiplier=0.5 \(Granite alone has it, always\)"),
            (ModelConfig(model_type="granite", **base), r"attention_multiplier=None \(Granite alone has it, always\)"),
            (ModelConfig(model_type="granite", attention_multiplier=1.0, sliding_windows=(4, 4), **base),
             r"sliding_windows=\(4, 4\) \(Granite has no sliding window\)"),
            (ModelConfig(model_type="qwen2_moe", qkv_bias=True, **moe, **base),
             r"shared_expert_intermediate_size=0 \(Qwen2-MoE alone has a shared expert, always; Granite-MoE-shared"),
            (ModelConfig(model_type="qwen3_moe", qk_norm=True, shared_expert_intermediate_size=16, **moe, **base),
             r"a qwen3_moe config.json cannot express shared_expert_intermediate_size=16"),
            (ModelConfig(model_type="qwen2_moe", qkv_bias=True, o_bias=True, shared_expert_intermediate_size=16, **moe,
                         **base), r"o_bias=True \(Qwen2-MoE's o_proj has no bias"),
            (ModelConfig(model_type="olmoe", **dict(olmoe, moe_intermediate_size=16), **base),
             r"moe_intermediate_size=16 \(OLMoE's experts are intermediate_size wide, 64\)"),
            (ModelConfig(model_type="olmoe", **dict(olmoe, qk_norm_full=False), **base), r"qk_norm_full=False"),
            (ModelConfig(model_type="olmoe", **olmoe, **dict(base, head_dim=16)), r"head_dim=16 \(OLMoE's is hidden"),
            (ModelConfig(model_type="mixtral", clip_qkv=8.0, **moe, **base), r"clip_qkv=8.0 \(OLMoE alone has it\)"),
            (ModelConfig(model_type="granitemoe", **moe, **base), r"attention_multiplier=None \(Granite alone"),
            (ModelConfig(model_type="granitemoe", attention_multiplier=1.0, **dict(moe, moe_norm_topk=False), **base),
             r"moe_norm_topk=False or experts narrower than intermediate_size \(Mixtral and Granite-MoE renormalise"),
            (ModelConfig(model_type="granitemoe", attention_multiplier=1.0, shared_expert_intermediate_size=16, **moe,
                         **base), r"a granitemoe config.json cannot express shared_expert_intermediate_size=16"),
            (ModelConfig(model_type="granitemoeshared", attention_multiplier=1.0, sliding_windows=(4, 4), **moe,
                         **base), r"sliding_windows=\(4, 4\) \(Granite has no sliding window\)"),
            (ModelConfig(model_type="llama", lm_head_bias=True, **base), r"lm_head_bias=True \(Phi-3.5-MoE alone"),
            (ModelConfig(model_type="llama", layer_norm=True, **base), r"cannot express layer_norm=True"),
            (ModelConfig(model_type="mixtral", sparsemixer_eps=0.01, **dict(moe, moe_norm_topk=False), **base),
             r"sparsemixer_eps=0.01 \(Phi-3.5-MoE alone routes by sparsemixer, always\)"),
            (ModelConfig(model_type="phimoe", layer_norm=True, **dict(moe, moe_norm_topk=False), **base),
             r"sparsemixer_eps=None \(Phi-3.5-MoE alone"),
            (ModelConfig(model_type="phimoe", layer_norm=True, sparsemixer_eps=0.01, rope_scaling=phi3_rope,
                         **dict(moe, moe_norm_topk=False), **base), r"longrope with no mscales"),
            (ModelConfig(model_type="phi3", rope_scaling=phimoe_rope, **base),
             r"longrope with \['long_mscale', 'short_mscale'\] mscales"),
            (ModelConfig(model_type="phimoe", layer_norm=True, sparsemixer_eps=0.01,
                         rope_scaling=(("factor", 2.0), ("rope_type", "linear")), **dict(moe, moe_norm_topk=False),
                         **base), r"rope_type='linear' \(Phi-3.5-MoE's RoPE is default or longrope\)")]:
        with pytest.raises(ConfigError, match=match):
            cfg.to_hf_dict()
    with pytest.raises(ConfigError, match=r"attention_multiplier \(Granite\) and query_pre_attn_scalar"):
        ModelConfig(model_type="granite", attention_multiplier=1.0, query_pre_attn_scalar=24, **base)
    with pytest.raises(ConfigError, match=r"shared_expert_intermediate_size=16: a shared expert sits beside"):
        ModelConfig(model_type="qwen2_moe", shared_expert_intermediate_size=16, **base)
    with pytest.raises(ConfigError, match=r"logits_scaling=0: the logits are divided by it"):
        ModelConfig(model_type="granite", attention_multiplier=1.0, logits_scaling=0.0, **base)
    for bad in (dict(num_experts_per_tok=1, moe_norm_topk=False), dict(moe_norm_topk=True)):
        with pytest.raises(ConfigError, match=r"sparsemixer routing picks two experts and weights them as they are"):
            ModelConfig(model_type="phimoe", sparsemixer_eps=0.01, **{**moe, **bad}, **base)
    with pytest.raises(ConfigError, match=r"sparsemixer_eps must be a finite number >= 0, got -1.0"):
        ModelConfig(model_type="phimoe", sparsemixer_eps=-1.0, **dict(moe, moe_norm_topk=False), **base)
    with pytest.raises(ConfigError, match=r"layer_norm=True \(LayerNorms\) with qk_norm or norm_plus_one"):
        ModelConfig(model_type="phimoe", layer_norm=True, qk_norm=True, **base)


COHERE = dict(GRANITE, model_type="cohere")
COHERE2 = dict(GRANITE, model_type="cohere2")


@pytest.mark.parametrize("cfg, message", [
    (dict(COHERE, logit_scale=None), r"unsupported cohere logit_scale=None; it takes a finite number \(the logits are "
                                     r"multiplied by it\)"),
    (dict(COHERE2, logit_scale="0.5"), r"unsupported cohere2 logit_scale='0.5'"),
    (dict(COHERE2, sliding_window=None), r"has sliding-attention layers but sliding_window is None; set it \(.*"
                                         r"Command R7B: 4096"),
    (dict(COHERE2, layer_types=["full_attention"]), r"layer_types has 1 entries for 2 layers"),
    (dict(COHERE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"unsupported rope_type='dynamic'; supported: default, llama3, linear, yarn"),
    (dict(COHERE, hidden_act="relu"), r"unsupported hidden_act='relu'"),
])
def test_unsupported_cohere_options_are_refused_at_load(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(cfg)


def test_cohere_configs_read_as_transformers_reads_them():
    """Command R7B's windows and RoPE by layer_types, or (the released form) every sliding_window_pattern-th layer
    full: RoPE on the sliding layers alone; its attention reads no use_qk_norm (kept for the save). Command-R reads
    no window, its query / key norms by use_qk_norm, head_dim when given."""
    c = ModelConfig.from_hf_dict(dict(COHERE2, num_hidden_layers=8, sliding_window=16))
    assert (c.sliding_windows, c.rope_layers) == ((16, 16, 16, 0) * 2, (1, 1, 1, 0) * 2)
    c = ModelConfig.from_hf_dict(dict(COHERE2, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=2,
                                      use_qk_norm=True))
    assert (c.sliding_windows, c.rope_layers, c.qk_norm) == ((16, 0, 16, 0), (1, 0, 1, 0), False)
    assert c.to_hf_dict()["use_qk_norm"] is True  # not read, kept as config.json said it
    c = ModelConfig.from_hf_dict(dict(COHERE2, layer_types=["full_attention"] * 2))
    assert (c.sliding_windows, c.rope_layers) == ((0, 0), (0, 0))  # no positional encoding at all
    c = ModelConfig.from_hf_dict(dict(COHERE, sliding_window=4, use_qk_norm=True, head_dim=16, attention_bias=True))
    assert (c.sliding_windows, c.qk_norm, c.qk_norm_head_scales, c.head_dim, c.qkv_bias, c.o_bias) == (
        (0, 0), True, True, 16, True, True)
    out = c.to_hf_dict()
    assert (out["architectures"], out["layer_norm_eps"], out["use_qk_norm"], "rms_norm_eps" in out) == (
        ["CohereForCausalLM"], 1e-5, True, False)


def test_cohere_networks_a_layout_cannot_say_are_not_saved():
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
    cohere = dict(parallel_block=True, norm_center=True)
    for cfg, match in [
            (ModelConfig(model_type="llama", logit_scale=0.3, **base),
             r"a llama config.json cannot express logit_scale=0.3 \(Command-R and Command R7B alone have it\)"),
            (ModelConfig(model_type="llama", **cohere, **base),
             r"a llama config.json cannot express parallel_block=True, norm_center=True"),
            (ModelConfig(model_type="cohere", parallel_block=True, **base), r"cannot express norm_center=False"),
            (ModelConfig(model_type="cohere", qk_norm=True, **cohere, **base),
             r"a cohere config.json cannot express qk_norm_head_scales=False"),
            (ModelConfig(model_type="cohere2", qk_norm=True, qk_norm_head_scales=True, **cohere, **base),
             r"a cohere2 config.json cannot express qk_norm=True, qk_norm_head_scales=True"),
            (ModelConfig(model_type="cohere", sliding_windows=(4, 4), **cohere, **base),
             r"sliding_windows=\(4, 4\) \(Command-R has no sliding window\)"),
            (ModelConfig(model_type="cohere", rope_layers=(1, 0), **cohere, **base),
             r"rope_layers=\(1, 0\) \(SmolLM3 alone has layers without RoPE\)"),
            (ModelConfig(model_type="cohere2", sliding_windows=(4, 0), **cohere, **base),
             r"rope_layers=\(\) \(Command R7B's RoPE is on its sliding-window layers alone: \(1, 0\)\)"),
            (ModelConfig(model_type="cohere2", sliding_windows=(4, 0), rope_layers=(0, 1), **cohere, **base),
             r"rope_layers=\(0, 1\) \(Command R7B's RoPE"),
            (ModelConfig(model_type="cohere", mlp_bias=True, **cohere, **base), r"mlp_bias=True \(only llama"),
            (ModelConfig(model_type="cohere", qkv_bias=True, **cohere, **base),
             r"qkv_bias=True with o_bias=False \(attention_bias sets both\)")]:
        with pytest.raises(ConfigError, match=match):
            cfg.to_hf_dict()
    # what a Command R7B config.json says: all-sliding layers rotate everywhere, a full one not at all
    assert ModelConfig(model_type="cohere2", sliding_windows=(4, 4), **cohere, **base).to_hf_dict()["layer_types"] == [
        "sliding_attention"] * 2
    with pytest.raises(ConfigError, match=r"qk_norm_head_scales=True \(a query / key norm scale per head\) needs "
                                          r"qk_norm=True and excludes qk_norm_full"):
        ModelConfig(model_type="cohere", qk_norm_head_scales=True, **cohere, **base)
    with pytest.raises(ConfigError, match=r"parallel_block .* excludes post_norms and sandwich_norms"):
        ModelConfig(model_type="cohere", parallel_block=True, post_norms=True, **base)
    with pytest.raises(ConfigError, match=r"logit_scale must be a finite number, got inf"):
        ModelConfig(model_type="cohere", logit_scale=float("inf"), **cohere, **base)


@pytest.fixture(scope="module")
def cohere_saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohere")
    make_hf_model("cohere", vocab_size=VOCAB, use_qk_norm=True).save_pretrained(str(root))
    return root


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(32, np.float32)}),
     r"'model.layers.0.self_attn.q_norm.weight' has shape \(32,\), expected \(4, 8\)"),
    (lambda t: t.update({"model.layers.1.post_attention_layernorm.weight": np.ones(32, np.float32)}),
     r"not used by a cohere model with this config.json: model.layers.1.post_attention_layernorm.weight"),
    (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
     r"missing weight tensor 'model.layers.1.self_attn.k_norm.weight' \(expected shape \(2, 8\)\)"),
], ids=["flat_q_norm", "mlp_norm", "k_norm"])
def test_cohere_tensors_are_checked_by_name(cohere_saved, tmp_path, edit, message):
    """Command-R's per-head norm scales are [heads, head_dim]; its parallel block has no second norm."""
    d = Path(shutil.copytree(cohere_saved, tmp_path / "cohere"))
    edit_tensors(d, edit)
    with pytest.raises(CheckpointError, match=message):
        load_params(d)


def test_biases_a_layout_cannot_say_are_not_saved():
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
    for cfg, match in [(ModelConfig(model_type="qwen3", qk_norm=True, qkv_bias=True, **base),
                        r"qkv_bias=True with o_bias=False \(attention_bias sets both\)"),
                       (ModelConfig(model_type="mistral", qkv_bias=True, o_bias=True, **base),
                        r"attention biases \(transformers' Mistral and Mixtral attention has none\)"),
                       (ModelConfig(model_type="gemma", norm_plus_one=True, scale_embed=True, mlp_bias=True,
                                    activation="gelu_tanh", **base), r"mlp_bias=True \(only llama, smollm3"),
                       (ModelConfig(model_type="mixtral", num_experts=2, num_experts_per_tok=1,
                                    moe_intermediate_size=64, **dict(base, num_layers=2), sliding_windows=(4, 0)),
                        r"one window for every layer")]:
        with pytest.raises(ConfigError, match=match):
            cfg.to_hf_dict()
    # and on load, the keys a layout does not read are ignored as transformers ignores them
    loaded = ModelConfig.from_hf_dict(dict(model_type="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4, attention_bias=True,
                                           mlp_bias=True))
    assert not (loaded.qkv_bias or loaded.o_bias or loaded.mlp_bias)


PHI3 = dict(model_type="phi3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
OLMO3 = dict(model_type="olmo3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _longrope(n=4, **kw):
    return dict(rope_type="longrope", short_factor=[1.0] * n, long_factor=[2.0] * n, rope_theta=1e4, **kw)


@pytest.mark.parametrize("cfg, message", [
    (dict(PHI3, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     r"unsupported rope_type='llama3' for phi3; supported: default, longrope"),
    (dict(PHI3, partial_rotary_factor=0.625), r"partial_rotary_factor=0.625 gives 5 rotary dims of head_dim=8 "
                                              r"\(int\(head_dim \* factor\)\); jaxdecode's RoPE rotates an even"),
    (dict(PHI3, partial_rotary_factor=1.5), r"unsupported partial_rotary_factor=1.5; it takes a number in \(0, 1\]"),
    (dict(PHI3, partial_rotary_factor=0.75, rope_parameters=_longrope(4)),
     r"longrope's short_factor must be a list of 3 positive numbers \(one per rotary frequency: head_dim 8 x "
     r"partial_rotary_factor 0.75 / 2\), got \(1.0, 1.0, 1.0, 1.0\)"),
    (dict(PHI3, rope_parameters=dict(_longrope(), long_factor=None)),
     r"longrope needs long_factor, a list of numbers, in config.json's rope scaling; got None"),
    (dict(PHI3, rope_parameters=_longrope(mscale=2.0)), r"unsupported longrope keys \['mscale'\]"),
    (dict(PHI3, rope_parameters=_longrope(attention_factor=-1.0)),
     r"longrope's attention_factor must be a positive number, got -1.0"),
    (dict(OLMO3, sliding_window=None, layer_types=["sliding_attention", "full_attention"]),
     r"has sliding-attention layers but sliding_window is None; set it \(.*OLMo 3: 4096\)"),
    (dict(OLMO3, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                  "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     r"unsupported rope_type='linear' for OLMo 3's sliding-window layers; supported: default"),
    (dict(OLMO3, rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"unsupported rope_type='dynamic'; supported: default, llama3, linear, yarn"),
    (dict(PHI3, model_type="llama", rope_parameters=_longrope()),
     r"unsupported rope_type='longrope'; supported: default, llama3, linear, yarn"),
])
def test_unsupported_phi3_and_olmo_options_are_refused_at_load(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(cfg)


def test_phi3_and_olmo3_configs_read_as_transformers_reads_them():
    """Keys left out take the class defaults (Phi-3: a 4096-token pretraining length, no window; OLMo 3: RoPE
    base 500000, window 4096 on three layers of four); Phi-3's "su" / "yarn" are longrope, its top-level
    original_max_position_embeddings and partial_rotary_factor are read (the released 4.x form), the former over
    rope_parameters' own; OLMo 2 has no window whatever its config.json says."""
    from jaxdecode.models.config import rope_attention_factor
    c = ModelConfig.from_hf_dict(dict(PHI3, rope_scaling=dict(type="su", short_factor=[1.0] * 3, long_factor=[2.0] * 3),
                                      partial_rotary_factor=0.75))
    sc = dict(c.rope_scaling)
    assert (sc["rope_type"], sc["original_max_position_embeddings"], c.partial_rotary_factor, c.rotary_dim,
            c.sliding_windows, c.norm_eps, c.tie_word_embeddings) == ("longrope", 4096, 0.75, 6, (0, 0), 1e-5, False)
    assert rope_attention_factor(c) == 1.0  # max_position_embeddings 256 < 4096: nothing to stretch
    c = ModelConfig.from_hf_dict(dict(PHI3, original_max_position_embeddings=64, sliding_window=16,
                                      rope_parameters=_longrope(original_max_position_embeddings=128)))
    assert dict(c.rope_scaling)["original_max_position_embeddings"] == 64 and c.sliding_windows == (16, 16)
    assert rope_attention_factor(c) == pytest.approx(np.sqrt(1 + np.log(256 / 64) / np.log(64)))
    c = ModelConfig.from_hf_dict(dict(OLMO3, num_hidden_layers=4))
    assert (c.rope_theta, c.local_rope_theta, c.sliding_windows) == (5e5, 5e5, (4096, 4096, 4096, 0))
    # the 4.x form: Olmo3Config gives rope_theta to the full layers, the sliding ones keep 500000
    c = ModelConfig.from_hf_dict(dict(OLMO3, rope_theta=1e4, layer_types=["sliding_attention", "full_attention"]))
    assert (c.rope_theta, c.local_rope_theta) == (1e4, 5e5)
    c = ModelConfig.from_hf_dict(dict(OLMO3, model_type="olmo2", sliding_window=4,
                                      layer_types=["sliding_attention"] * 2))
    assert (c.sliding_windows, c.post_norms, c.qk_norm_full, c.local_rope_theta) == ((0, 0), True, True, None)


def test_phi3_and_olmo_networks_a_layout_cannot_say_are_not_saved():
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, max_position_embeddings=64)
    olmo = dict(post_norms=True, qk_norm=True, qk_norm_full=True)
    for cfg, match in [
            (ModelConfig(model_type="llama", **olmo, **base), r"a llama config.json cannot express qk_norm=True, "
                                                             r"post_norms=True, qk_norm_full=True"),
            (ModelConfig(model_type="olmo2", **dict(olmo, qk_norm_full=False), **base), r"qk_norm_full=False"),
            (ModelConfig(model_type="llama", partial_rotary_factor=0.75, **base),
             r"partial_rotary_factor=0.75 \(longrope is Phi-3's and Phi-3.5-MoE's alone, a partial rotary factor "
             r"Phi-3's alone\)"),
            (ModelConfig(model_type="phi3", rope_scaling=(("factor", 2.0), ("rope_type", "linear")), **base),
             r"rope_type='linear' \(Phi-3's RoPE is default or longrope\)"),
            (ModelConfig(model_type="phi3", sliding_windows=(4, 0), **base), r"one window for every layer"),
            (ModelConfig(model_type="phi3", qkv_bias=True, o_bias=True, **base), r"attention biases"),
            (ModelConfig(model_type="olmo2", sliding_windows=(4, 0), **olmo, **base), r"OLMo 2 has no sliding window"),
            (ModelConfig(model_type="olmo3", **olmo, **base), r"local_rope_theta=None \(Gemma 3 and OLMo 3 alone")]:
        with pytest.raises(ConfigError, match=match):
            cfg.to_hf_dict()
    with pytest.raises(ConfigError, match=r"qk_norm_full=True \(query / key norms over all heads\) needs qk_norm"):
        ModelConfig(model_type="olmo2", post_norms=True, qk_norm_full=True, **base)
    with pytest.raises(ConfigError, match=r"post_norms .* and sandwich_norms .* exclude each other"):
        ModelConfig(model_type="olmo2", post_norms=True, sandwich_norms=True, **base)


def _truncate_rows_of(name):
    def edit(t):
        t[name] = t[name][:-1]
    return edit


@pytest.fixture(scope="module")
def phi3_saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    make_hf_model("phi3", vocab_size=VOCAB).save_pretrained(str(root))
    return root


@pytest.mark.parametrize("edit, message", [
    (_truncate_rows_of("model.layers.0.self_attn.qkv_proj.weight"),
     r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(63, 32\), expected \(64, 32\)"),
    (lambda t: t.pop("model.layers.1.mlp.gate_up_proj.weight"),
     r"missing weight tensor 'model.layers.1.mlp.gate_up_proj.weight' \(expected shape \(128, 32\)\)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}),
     r"not used by a phi3 model with this config.json: model.layers.0.self_attn.q_proj.weight"),
], ids=["qkv_proj", "gate_up_proj", "unfused_q_proj"])
def test_phi3_fused_tensors_are_checked_by_name(phi3_saved, tmp_path, edit, message):
    d = Path(shutil.copytree(phi3_saved, tmp_path / "phi3"))
    edit_tensors(d, edit)
    with pytest.raises(CheckpointError, match=message):
        load_params(d)


def test_smollm3_no_rope_layers():
    cfg = dict(model_type="smollm3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=2)
    assert ModelConfig.from_hf_dict(cfg).rope_layers == (1, 1, 1, 0, 1, 1, 1, 0)  # every 4th, as transformers
    assert ModelConfig.from_hf_dict(dict(cfg, no_rope_layer_interval=2)).rope_layers == (1, 0) * 4
    with pytest.raises(ConfigError, match=r"no_rope_layers must be a list of 0 / 1 for the 8 layers, got \[1, 0\]"):
        ModelConfig.from_hf_dict(dict(cfg, no_rope_layers=[1, 0]))


def test_a_layout_that_cannot_express_the_network_is_not_saved(tmp_path):
    import jax
    from jaxdecode.models import init_params, save_params
    cfg = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, qk_norm=True)
    with pytest.raises(ConfigError, match=r"a llama config.json cannot express qk_norm=True \(the layouts that "
                                          r"imply these options: qwen3: qk_norm"):
        save_params(cfg, init_params(cfg, jax.random.PRNGKey(0)), tmp_path)
    with pytest.raises(ConfigError, match=r"cannot express .*local_rope_theta=100.0"):
        cfg.replace(qk_norm=False, local_rope_theta=100.0).to_hf_dict()
    with pytest.raises(ConfigError, match=r"cannot express rope_layers=\(0,\) \(SmolLM3 alone"):
        cfg.replace(qk_norm=False, rope_layers=(0,)).to_hf_dict()
    with pytest.raises(ConfigError, match=r"one sliding_window for every windowed layer; this config has "
                                          r"several: \[2, 4\]"):
        ModelConfig(model_type="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                    sliding_windows=(2, 4)).to_hf_dict()


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


# ----------------------------------------------------------------------------- damaged files
# Each case breaks one file of a saved checkpoint; loading must give one CheckpointError that names
# the file and what is wrong (no chained library traceback), and the CLI must print it on one line.
def _rewrite_header(path: Path, edit) -> None:
    """Re-write a safetensors file's JSON header after `edit(header)`; the data bytes stay as they are."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _first_tensor(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _grow_shape(header):  # the header claims more elements than the tensor's byte range holds
    k = _first_tensor(header)
    header[k]["shape"] = [header[k]["shape"][0] * 2] + header[k]["shape"][1:]


def _past_the_end(header):  # consistent sizes, but the last tensor's bytes end past the end of the file
    k = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    shape = header[k]["shape"]
    row = int(np.prod(shape[1:])) * 4  # F32
    header[k]["shape"] = [shape[0] + 8] + shape[1:]
    header[k]["data_offsets"][1] += 8 * row


def _truncate(path: Path):
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


DAMAGED = {
    # name: (file to break, how, pattern the message must match)
    "truncated": ("model.safetensors", _truncate,
                  r"model.safetensors is truncated: .* but the file has \d+ bytes"),
    "garbage": ("model.safetensors", lambda p: p.write_bytes(b"<html>404 Not Found</html>" * 40),
                r"model.safetensors is not a safetensors file"),
    "empty": ("model.safetensors", lambda p: p.write_bytes(b""),
              r"model.safetensors is not a safetensors file: it is empty"),
    "header_not_json": ("model.safetensors",
                        lambda p: p.write_bytes((20).to_bytes(8, "little") + b"{this is not json!!}" + b"\0" * 64),
                        r"model.safetensors is not a safetensors file: its header is not JSON"),
    "header_lies_about_shape": ("model.safetensors", lambda p: _rewrite_header(p, _grow_shape),
                                r"model.safetensors has an inconsistent header: tensor '.*' is F32 "
                                r"\[\d+(, \d+)*\] \(\d+ bytes\) but its data_offsets span \d+ bytes"),
    "header_lies_about_length": ("model.safetensors", lambda p: _rewrite_header(p, _past_the_end),
                                 r"model.safetensors is truncated: tensor '.*' ends at byte \d+ but the "
                                 r"file has \d+ bytes"),
    "config_not_json": ("config.json", lambda p: p.write_text('{"model_type": "llama",'),
                        r"config.json is not valid JSON \(.*line 1 column \d+\)"),
    "config_not_an_object": ("config.json", lambda p: p.write_text("[1, 2]"),
                             r"config.json must hold a JSON object .*, found a JSON array"),
    "config_missing_key": ("config.json", lambda p: p.write_text(json.dumps(
        {k: v for k, v in json.loads(p.read_text()).items() if k != "hidden_size"})),
        r"config.json has no 'hidden_size', which a llama config needs"),
    "generation_config_not_json": ("generation_config.json", lambda p: p.write_text("{oops"),
                                   r"generation_config.json is not valid JSON"),
    "tokenizer_not_json": ("tokenizer.json", lambda p: p.write_text("{oops"),
                           r"tokenizer.json is not valid JSON \(.*line 1 column 2\)"),
    "tokenizer_unreadable": ("tokenizer.json", lambda p: p.write_text('{"model": {"type": "nonsense"}}'),
                             r"the tokenizer in .* cannot be loaded \(.*\); fix or replace its tokenizer"),
}


@pytest.fixture(scope="module")
def saved_with_tokenizer(saved):
    from jd_testutil import make_tokenizer
    make_tokenizer(saved / "llama_tok", VOCAB)
    shutil.copytree(saved / "llama", saved / "llama_tok", dirs_exist_ok=True)
    cfg = json.loads((saved / "llama_tok" / "config.json").read_text())
    cfg.pop("eos_token_id", None)  # so generation_config.json is read
    (saved / "llama_tok" / "config.json").write_text(json.dumps(cfg))
    return saved / "llama_tok"


def _damaged(saved_with_tokenizer, tmp_path, case) -> tuple[Path, Path]:
    d = Path(shutil.copytree(saved_with_tokenizer, tmp_path / case))
    fname, breaker, _ = DAMAGED[case]
    breaker(d / fname)
    return d, d / fname


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_file_is_one_clear_error(saved_with_tokenizer, tmp_path, case):
    import jaxdecode
    d, broken = _damaged(saved_with_tokenizer, tmp_path, case)
    with pytest.raises((CheckpointError, ConfigError), match=DAMAGED[case][2]) as info:
        jaxdecode.load(d)
    err = info.value
    assert str(broken) in str(err) or str(d) in str(err)
    assert err.__cause__ is None and (err.__suppress_context__ or err.__context__ is None)
    assert "\n" not in str(err)


@pytest.mark.parametrize("case", ["truncated", "garbage", "config_not_json", "tokenizer_not_json"])
def test_cli_damaged_file_prints_one_line(saved_with_tokenizer, tmp_path, capsys, case):
    from jaxdecode.cli import main
    d, broken = _damaged(saved_with_tokenizer, tmp_path, case)
    rc = main(["generate", "--model", str(d), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith("jaxdecode: error: ") and d.name in err


def _sharded(saved, tmp_path) -> Path:
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(str(saved / "llama")).save_pretrained(str(tmp_path / "sharded"),
                                                                               max_shard_size="20KB")
    return tmp_path / "sharded"


def test_damaged_shard_and_index(saved, tmp_path):
    d = _sharded(saved, tmp_path)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    _truncate(shards[1])
    with pytest.raises(CheckpointError, match=rf"{shards[1].name} is truncated"):
        load_params(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is not valid JSON"):
        load_params(d)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json has no \"weight_map\" object"):
        load_params(d)
