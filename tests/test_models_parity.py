"""Parity of jaxdecode.models with transformers (PyTorch, f32) on tiny random checkpoints.

Every variant is built once per module (a torch model saved with save_pretrained, loaded with
load_params, and both run on one right-padded batch); the tests then compare the stored logits, so
each architecture compiles the JAX forward once. Only valid (non-padding) positions are compared.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jd_testutil import make_hf_model, phimoe_rope_by_length
from jaxdecode.models import forward, load_params, padded_causal_mask, save_params

VOCAB = 64
BATCH_LENGTHS = np.array([12, 9, 5])  # right-padded rows of different lengths
SEQ = int(BATCH_LENGTHS.max())
ATOL = 1e-5

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # smaller than SEQ, so the scaled long-wavelength frequencies shape the logits
               "original_max_position_embeddings": 8, "rope_theta": 10000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
# YaRN over a pretraining length below SEQ with a base small enough that the ramp spans the dimensions
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6, "rope_theta": 100.0}
# Phi-3's LongRoPE (head_dim 8: 4 frequencies; 3 with a partial rotary factor of 0.75). Its pretraining length
# (top-level original_max_position_embeddings) is 64 (> SEQ: the short factors) or 4 (< every row: the long ones)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 8.0],
            "rope_theta": 10000.0}
LONGROPE_3 = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [3.0, 4.0, 5.0],
              "rope_theta": 10000.0}
# Phi-3.5-MoE's LongRoPE: its pretraining length inside rope_parameters (64 > SEQ: the short factors), cos and sin
# times short_mscale, or long_mscale with the long factors (the released model has both 1.243...)
PHIMOE_LONGROPE = dict(LONGROPE, short_mscale=1.2, long_mscale=1.5, original_max_position_embeddings=64)

# name -> (HF family, config overrides on top of jd_testutil's tiny defaults: hidden 32, 2 layers,
# 4 heads, 2 kv heads)
VARIANTS = {
    "llama_gqa_untied_llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama_mha_tied_linear_biases": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                   rope_parameters=LINEAR_ROPE, attention_bias=True,
                                                   mlp_bias=True)),
    "qwen2_biases_head_dim16": ("qwen2", dict(head_dim=16)),  # head_dim != hidden / heads (8)
    "qwen2_random_biases": ("qwen2", dict(random_biases=True)),
    "qwen2_window_on_layer1": ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                                             max_window_layers=1,
                                             layer_types=["full_attention", "sliding_attention"])),
    "qwen3_qk_norm_head_dim16": ("qwen3", dict(head_dim=16, random_norms=True)),
    "qwen3_yarn": ("qwen3", dict(head_dim=16, rope_parameters=YARN_ROPE)),
    "qwen3_biases_tied_window": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True, random_norms=True,
                                               use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                               layer_types=["full_attention", "sliding_attention"])),
    # layer 1 without RoPE (its YaRN attention factor off too), layer 0 with YaRN
    "smollm3_nope_yarn": ("smollm3", dict(no_rope_layers=[1, 0], rope_parameters=YARN_ROPE)),
    "smollm3_window_on_nope": ("smollm3", dict(no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=4,
                                               layer_types=["full_attention", "sliding_attention"])),
    "gemma_mha": ("gemma", dict(num_key_value_heads=4, random_norms=True)),
    # both soft-caps low enough to bend the scores and logits; sliding layer 0, full layer 1
    "gemma2_softcaps_window": ("gemma2", dict(random_norms=True, sliding_window=4, query_pre_attn_scalar=24,
                                              attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    # sliding layer 0 (its own unscaled RoPE base), full layer 1 (linear scaling), a query scale that is
    # not head_dim's, untied
    "gemma3_window_local_rope": ("gemma3_text", dict(
        random_norms=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # YaRN on the full layer only: the sliding layer keeps its own unscaled RoPE and no attention factor
    "gemma3_yarn_on_full": ("gemma3_text", dict(
        random_norms=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(YARN_ROPE), "sliding_attention": {"rope_type": "default",
                                                                                   "rope_theta": 100.0}})),
    "mistral_window4": ("mistral", dict(sliding_window=4)),  # window < sequence length
    "mixtral_4x2": ("mixtral", {}),
    "qwen3_moe_4x2_norm_topk": ("qwen3_moe", dict(norm_topk_prob=True, random_norms=True)),
    "qwen3_moe_4x2_raw_topk": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen3_moe_window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # Phi-4-mini's options: a partial rotary factor (6 of 8 dims rotate), tied; a window over every layer
    "phi3_partial_window_tied": ("phi3", dict(random_norms=True, partial_rotary_factor=0.75, sliding_window=4,
                                              tie_word_embeddings=True)),
    "phi3_longrope_short": ("phi3", dict(rope_parameters=LONGROPE, original_max_position_embeddings=64)),
    "phi3_longrope_partial_long": ("phi3", dict(random_norms=True, partial_rotary_factor=0.75,
                                                rope_parameters=LONGROPE_3, original_max_position_embeddings=4)),
    "olmo2_post_norms_biases": ("olmo2", dict(random_norms=True, attention_bias=True)),
    # sliding layer 0 (its own unscaled RoPE base), full layer 1 with YaRN
    "olmo3_window_yarn": ("olmo3", dict(
        random_norms=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(YARN_ROPE), "sliding_attention": {"rope_type": "default",
                                                                                   "rope_theta": 1000.0}})),
    # every multiplier away from 1 (Granite 3's own: 12, 0.22, 1/128, 8 or 16), attention and MLP biases
    "granite_multipliers_biases": ("granite", dict(
        random_norms=True, random_biases=True, attention_bias=True, mlp_bias=True, embedding_multiplier=3.0,
        residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5)),
    "granite_tied_head_dim16_llama3": ("granite", dict(
        tie_word_embeddings=True, head_dim=16, rope_parameters=LLAMA3_ROPE, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=8.0)),
    # q/k/v biases and the gated shared expert; raw top-k weights (norm_topk_prob's default)
    "qwen2_moe_shared_random_biases": ("qwen2_moe", dict(random_biases=True, random_norms=True)),
    # transformers 5's default windows: the even layers below max_window_layers (here layer 0 of 2)
    "qwen2_moe_norm_topk_window": ("qwen2_moe", dict(norm_topk_prob=True, use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=1)),
    "olmoe_norm_topk": ("olmoe", dict(random_norms=True, norm_topk_prob=True)),
    "olmoe_raw_topk_clip_biases": ("olmoe", dict(random_norms=True, random_biases=True, attention_bias=True,
                                                 clip_qkv=0.5)),
    # Command-R: per-head query / key LayerNorms (a scale per head), attention biases (q / k ones permuted to the
    # half-split RoPE layout with the rows), a logit_scale that is not a power of 2; tied (its default)
    "cohere_qk_norm_biases": ("cohere", dict(random_norms=True, random_biases=True, use_qk_norm=True,
                                             attention_bias=True, logit_scale=0.3)),
    "cohere_untied_linear": ("cohere", dict(random_norms=True, tie_word_embeddings=False, logit_scale=2.0,
                                            rope_parameters=LINEAR_ROPE)),
    # Command R7B: sliding layer 0 (RoPE) beside full layer 1 (no positional encoding), window < SEQ
    "cohere2_window_nope": ("cohere2", dict(random_norms=True, sliding_window=4, logit_scale=0.5,
                                            layer_types=["sliding_attention", "full_attention"])),
    # Granite's multipliers away from 1 over fused experts (softmax over the top 2 logits), attention biases
    "granitemoe_multipliers_biases": ("granitemoe", dict(
        random_norms=True, random_biases=True, attention_bias=True, embedding_multiplier=3.0,
        residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5)),
    # the ungated dense shared MLP (40 wide) beside the experts, tied, llama3 RoPE
    "granitemoeshared_tied_llama3": ("granitemoeshared", dict(
        random_norms=True, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=8.0)),
    # LayerNorms with biases, attention and LM-head biases, LongRoPE short of its switch, sparsemixer at its
    # released jitter_eps (0.01: mostly one expert in each softmax)
    "phimoe_longrope_biases": ("phimoe", dict(random_norms=True, random_biases=True, attention_bias=True,
                                              lm_head_bias=True, rope_parameters=PHIMOE_LONGROPE)),
    # a jitter_eps that keeps several experts in each softmax, a window over every layer, tied with a head bias
    "phimoe_jitter_window_tied": ("phimoe", dict(random_norms=True, random_biases=True, lm_head_bias=True,
                                                 tie_word_embeddings=True, router_jitter_noise=0.5, sliding_window=4)),
    "gpt2_tied": ("gpt2", {}),
    "gpt2_untied": ("gpt2", dict(tie_word_embeddings=False)),
}


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (len(BATCH_LENGTHS), SEQ)).astype(np.int32)
    valid = np.arange(SEQ)[None, :] < BATCH_LENGTHS[:, None]
    return tokens, valid


def torch_logits(model, tokens, valid) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(valid, dtype=torch.long))
    return out.logits.float().numpy()


def jax_logits(config, params, tokens, valid) -> np.ndarray:
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, _ = forward(config, params, jnp.asarray(tokens), positions, None,
                           padded_causal_mask(jnp.asarray(valid)))
    return np.asarray(logits)


def max_valid_diff(a, b, valid) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))[valid].max())


class Built:
    """One variant: its checkpoint directory, the torch model, and both sides' logits."""

    def __init__(self, name: str, root: Path):
        kind, overrides = VARIANTS[name]
        self.name, self.kind, self.dir = name, kind, root / name
        self.torch_model = make_hf_model(kind, vocab_size=VOCAB, **overrides)
        self.torch_model.save_pretrained(str(self.dir))
        self.tokens, self.valid = _batch()
        self.torch_logits = torch_logits(self.torch_model, self.tokens, self.valid)
        self.config, self.params = load_params(self.dir)
        self.logits = jax_logits(self.config, self.params, self.tokens, self.valid)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = Built(name, root)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(built, name):
    v = built(name)
    assert v.logits.shape == (len(BATCH_LENGTHS), SEQ, VOCAB)
    assert np.isfinite(v.logits).all()
    assert max_valid_diff(v.logits, v.torch_logits, v.valid) <= ATOL


def test_variants_load_the_intended_shapes(built):
    """Guard against an override silently not taking effect (the parity would then prove less)."""
    c = built("llama_gqa_untied_llama3").config
    assert (c.num_heads, c.num_kv_heads, c.tie_word_embeddings) == (4, 2, False)
    assert dict(c.rope_scaling)["rope_type"] == "llama3"
    c = built("llama_mha_tied_linear_biases").config
    assert (c.num_kv_heads, c.tie_word_embeddings, c.qkv_bias, c.o_bias, c.mlp_bias) == (4, True, True,
                                                                                          True, True)
    assert "lm_head" not in built("llama_mha_tied_linear_biases").params
    c = built("qwen2_biases_head_dim16").config
    assert (c.head_dim, c.qkv_bias, c.o_bias) == (16, True, False)
    assert built("qwen2_window_on_layer1").config.sliding_windows == (0, 4)
    assert dict(built("qwen3_yarn").config.rope_scaling) == {k: v for k, v in YARN_ROPE.items() if k != "rope_theta"}
    c = built("smollm3_nope_yarn").config
    assert (c.rope_layers, c.sliding_windows, dict(c.rope_scaling)["rope_type"]) == ((1, 0), (0, 0), "yarn")
    assert built("smollm3_window_on_nope").config.sliding_windows == (0, 4)
    c = built("mixtral_4x2").config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_norm_topk) == (4, 2, 64, True)
    c = built("qwen3_moe_4x2_raw_topk").config
    assert (c.num_experts, c.moe_intermediate_size, c.moe_norm_topk, c.qk_norm) == (4, 24, False, True)
    assert built("qwen3_moe_4x2_norm_topk").config.moe_norm_topk
    assert built("qwen3_moe_window").config.sliding_windows == (4, 4)  # every layer, as transformers 5
    c = built("qwen3_qk_norm_head_dim16").config
    assert (c.head_dim, c.qk_norm, c.qkv_bias, c.o_bias, c.sliding_windows) == (16, True, False, False, (0, 0))
    c = built("qwen3_biases_tied_window").config
    assert (c.qk_norm, c.qkv_bias, c.o_bias, c.tie_word_embeddings, c.sliding_windows) == (True, True, True,
                                                                                          True, (0, 4))
    assert built("mistral_window4").config.sliding_windows == (4, 4)
    c = built("gemma_mha").config
    assert (c.norm_plus_one, c.scale_embed, c.sandwich_norms, c.qk_norm, c.activation, c.tie_word_embeddings,
            c.query_pre_attn_scalar, c.local_rope_theta) == (True, True, False, False, "gelu_tanh", True, None, None)
    c = built("gemma2_softcaps_window").config
    assert (c.sandwich_norms, c.qk_norm, c.sliding_windows, c.query_pre_attn_scalar, c.local_rope_theta) == (
        True, False, (4, 0), 24, None)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (1.5, 2.0)
    c = built("gemma3_window_local_rope").config
    assert (c.norm_plus_one, c.scale_embed, c.sandwich_norms, c.qk_norm) == (True,) * 4
    assert c.tie_word_embeddings is False
    assert (c.sliding_windows, c.query_pre_attn_scalar, c.local_rope_theta, c.rope_theta) == ((4, 0), 24.0, 100.0, 1e6)
    assert dict(c.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    assert built("gpt2_untied").config.tie_word_embeddings is False
    assert "lm_head" in built("gpt2_untied").params
    c = built("phi3_partial_window_tied").config
    assert (c.partial_rotary_factor, c.rotary_dim, c.sliding_windows, c.tie_word_embeddings, c.rope_scaling,
            c.qkv_bias) == (0.75, 6, (4, 4), True, None, False)
    c = built("phi3_longrope_short").config
    assert (c.rotary_dim, dict(c.rope_scaling)) == (8, dict(
        rope_type="longrope", short_factor=(1.0, 1.5, 2.0, 3.0), long_factor=(2.0, 4.0, 6.0, 8.0),
        original_max_position_embeddings=64))
    c = built("phi3_longrope_partial_long").config
    assert (c.rotary_dim, dict(c.rope_scaling)["original_max_position_embeddings"]) == (6, 4)
    c = built("olmo2_post_norms_biases").config
    assert (c.post_norms, c.qk_norm, c.qk_norm_full, c.sandwich_norms, c.qkv_bias, c.o_bias, c.sliding_windows) == (
        True, True, True, False, True, True, (0, 0))
    assert built("olmo2_post_norms_biases").params["layers"]["q_norm"]["scale"].shape == (2, 4, 8)
    assert "attn_norm" not in built("olmo2_post_norms_biases").params["layers"]
    c = built("olmo3_window_yarn").config
    assert (c.post_norms, c.qk_norm_full, c.sliding_windows, c.local_rope_theta, c.rope_theta) == (
        True, True, (4, 0), 1000.0, 100.0)
    assert dict(c.rope_scaling)["rope_type"] == "yarn"
    c = built("granite_multipliers_biases").config
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling, c.attn_scale,
            c.qkv_bias, c.o_bias, c.mlp_bias, c.tie_word_embeddings) == (3.0, 0.3, 0.2, 2.5, 0.2, True, True, True,
                                                                         False)
    c = built("granite_tied_head_dim16_llama3").config
    assert (c.head_dim, c.tie_word_embeddings, dict(c.rope_scaling)["rope_type"], c.attn_scale) == (
        16, True, "llama3", 0.125)
    c = built("qwen2_moe_shared_random_biases").config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size,
            c.moe_norm_topk, c.qkv_bias, c.o_bias, c.qk_norm, c.sliding_windows) == (4, 2, 24, 40, False, True, False,
                                                                                     False, (0, 0))
    assert built("qwen2_moe_shared_random_biases").params["layers"]["w_shared_gate"].shape == (2, 32, 1)
    c = built("qwen2_moe_norm_topk_window").config
    assert (c.moe_norm_topk, c.sliding_windows) == (True, (4, 0))
    c = built("olmoe_norm_topk").config
    assert (c.num_experts, c.moe_intermediate_size, c.moe_norm_topk, c.qk_norm_full, c.post_norms, c.clip_qkv,
            c.norm_scale_f32) == (4, 64, True, True, False, None, False)
    assert "attn_norm" in built("olmoe_norm_topk").params["layers"]
    c = built("olmoe_raw_topk_clip_biases").config
    assert (c.moe_norm_topk, c.clip_qkv, c.qkv_bias, c.o_bias) == (False, 0.5, True, True)
    c = built("cohere_qk_norm_biases").config
    assert (c.parallel_block, c.norm_center, c.qk_norm, c.qk_norm_head_scales, c.qk_norm_full, c.qkv_bias, c.o_bias,
            c.logit_scale, c.tie_word_embeddings, c.norm_scale_f32, c.rope_interleaved, c.norm_eps) == (
        True, True, True, True, False, True, True, 0.3, True, True, True, 1e-5)
    layers = built("cohere_qk_norm_biases").params["layers"]
    assert layers["q_norm"]["scale"].shape == (2, 4, 8) and layers["k_norm"]["scale"].shape == (2, 2, 8)
    assert "mlp_norm" not in layers and "lm_head" not in built("cohere_qk_norm_biases").params
    c = built("cohere_untied_linear").config
    assert (c.qk_norm, c.tie_word_embeddings, c.logit_scale, dict(c.rope_scaling)["rope_type"]) == (
        False, False, 2.0, "linear")
    c = built("cohere2_window_nope").config
    assert (c.sliding_windows, c.rope_layers, c.qk_norm, c.logit_scale, c.parallel_block, c.norm_center) == (
        (4, 0), (1, 0), False, 0.5, True, True)
    c = built("granitemoe_multipliers_biases").config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_norm_topk,
            c.shared_expert_intermediate_size, c.embedding_multiplier, c.residual_multiplier, c.attn_scale,
            c.logits_scaling, c.qkv_bias, c.o_bias, c.sliding_windows) == (4, 2, 64, True, 0, 3.0, 0.3, 0.2, 2.5,
                                                                           True, True, (0, 0))
    c = built("granitemoeshared_tied_llama3").config
    assert (c.shared_expert_intermediate_size, c.shared_expert_gated, c.tie_word_embeddings,
            dict(c.rope_scaling)["rope_type"]) == (40, False, True, "llama3")
    layers = built("granitemoeshared_tied_llama3").params["layers"]
    assert layers["ws_up"].shape == (2, 32, 40) and "w_shared_gate" not in layers
    assert c.replace(model_type="qwen2_moe").num_parameters() - c.num_parameters() == 2 * 32  # no gate vector
    c = built("phimoe_longrope_biases").config
    assert (c.layer_norm, c.lm_head_bias, c.qkv_bias, c.o_bias, c.num_experts, c.num_experts_per_tok,
            c.moe_intermediate_size, c.moe_norm_topk, c.sparsemixer_eps, c.sliding_windows, c.tie_word_embeddings,
            c.norm_eps) == (True, True, True, True, 4, 2, 64, False, 0.01, (0, 0), False, 1e-5)
    assert dict(c.rope_scaling) == dict(rope_type="longrope", short_factor=(1.0, 1.5, 2.0, 3.0),
                                        long_factor=(2.0, 4.0, 6.0, 8.0), short_mscale=1.2, long_mscale=1.5,
                                        original_max_position_embeddings=64)
    p = built("phimoe_longrope_biases").params
    assert (p["final_norm"]["bias"].shape, p["layers"]["attn_norm"]["bias"].shape, p["lm_head_bias"].shape) == (
        (32,), (2, 32), (64,))
    c = built("phimoe_jitter_window_tied").config
    assert (c.sparsemixer_eps, c.sliding_windows, c.tie_word_embeddings, c.lm_head_bias, c.qkv_bias,
            c.rope_scaling) == (0.5, (4, 4), True, True, False, None)


@pytest.mark.parametrize("name", ["llama_gqa_untied_llama3", "llama_mha_tied_linear_biases", "qwen3_yarn",
                                  "smollm3_nope_yarn", "gemma3_yarn_on_full",
                                  "mistral_window4", "qwen2_window_on_layer1", "qwen3_biases_tied_window",
                                  "phi3_partial_window_tied", "phi3_longrope_short", "phi3_longrope_partial_long",
                                  "olmo3_window_yarn", "granite_tied_head_dim16_llama3", "qwen2_moe_norm_topk_window",
                                  "cohere_untied_linear", "cohere2_window_nope", "granitemoeshared_tied_llama3",
                                  "phimoe_longrope_biases", "phimoe_jitter_window_tied"])
def test_rope_scaling_and_windows_matter(built, name):
    """Dropping the rope scaling / sliding window changes the logits, so parity above covers them."""
    v = built(name)
    plain = v.config.replace(rope_scaling=None, sliding_windows=(0,) * v.config.num_layers)
    assert plain != v.config
    assert max_valid_diff(jax_logits(plain, v.params, v.tokens, v.valid), v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("change", ["local_rope_theta", "query_pre_attn_scalar", "sandwich_norms",
                                    "norm_plus_one", "scale_embed"])
def test_gemma3_options_matter(built, change):
    """Each Gemma 3 option changes the logits, so the parity above covers it."""
    v = built("gemma3_window_local_rope")
    params = v.params
    if change == "sandwich_norms":
        params = {**params, "layers": {k: x for k, x in params["layers"].items()
                                       if k not in ("attn_out_norm", "mlp_out_norm")}}
    other = {"local_rope_theta": 1e6, "query_pre_attn_scalar": None}.get(change, False)
    logits = jax_logits(v.config.replace(**{change: other}), params, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("change", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma2_softcaps_matter(built, change):
    v = built("gemma2_softcaps_window")
    logits = jax_logits(v.config.replace(**{change: None}), v.params, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


def test_smollm3_layers_without_rope_matter(built):
    v = built("smollm3_nope_yarn")
    logits = jax_logits(v.config.replace(rope_layers=()), v.params, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("change", [dict(moe_norm_topk=True), dict(num_experts_per_tok=1)])
def test_moe_routing_matters(built, change):
    """Renormalising the top weights or routing to fewer experts changes the logits: parity covers them."""
    v = built("qwen3_moe_4x2_raw_topk")
    logits = jax_logits(v.config.replace(**change), v.params, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("name, change", [
    ("phi3_partial_window_tied", dict(partial_rotary_factor=1.0)),
    ("phi3_longrope_short", dict(short_factor=(1.0,) * 4)),  # the short factors are the ones used ...
    ("phi3_longrope_partial_long", dict(long_factor=(1.0, 1.5, 2.0))),  # ... and the long ones past the switch
    ("phi3_longrope_partial_long", dict(attention_factor=1.0)),
    ("olmo3_window_yarn", dict(local_rope_theta=100.0)),
])
def test_phi3_and_olmo3_rope_options_matter(built, name, change):
    """Each RoPE option of these layouts changes the logits, so the parity above covers it."""
    v = built(name)
    rope = {k: change.pop(k) for k in list(change) if k not in ("partial_rotary_factor", "local_rope_theta")}
    config = v.config.replace(**change)
    if rope:
        config = config.replace(rope_scaling=tuple(sorted({**dict(config.rope_scaling), **rope}.items())))
    assert config != v.config
    assert max_valid_diff(jax_logits(config, v.params, v.tokens, v.valid), v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("name, change", [
    ("granite_multipliers_biases", dict(embedding_multiplier=1.0)),
    ("granite_multipliers_biases", dict(residual_multiplier=1.0)),
    ("granite_multipliers_biases", dict(attention_multiplier=None)),  # head_dim ** -0.5 instead
    ("granite_multipliers_biases", dict(logits_scaling=1.0)),
    ("qwen2_moe_shared_random_biases", dict(moe_norm_topk=True)),
    ("qwen2_moe_norm_topk_window", dict(moe_norm_topk=False)),
    ("olmoe_norm_topk", dict(moe_norm_topk=False)),
    ("olmoe_raw_topk_clip_biases", dict(moe_norm_topk=True)),
    ("olmoe_raw_topk_clip_biases", dict(clip_qkv=None)),
    ("granitemoe_multipliers_biases", dict(moe_norm_topk=False)),  # the softmax over the top k only
    ("granitemoe_multipliers_biases", dict(residual_multiplier=1.0)),
    ("granitemoe_multipliers_biases", dict(attention_multiplier=None)),
    ("granitemoeshared_tied_llama3", dict(embedding_multiplier=1.0)),
    ("granitemoeshared_tied_llama3", dict(logits_scaling=1.0)),
    ("phimoe_longrope_biases", dict(short_mscale=1.0)),  # rope_scaling entries
    ("phimoe_longrope_biases", dict(short_factor=(1.0,) * 4)),
    ("phimoe_longrope_biases", dict(sparsemixer_eps=0.5)),
    ("phimoe_jitter_window_tied", dict(sparsemixer_eps=0.01)),
    ("phimoe_jitter_window_tied", dict(sparsemixer_eps=None)),  # a softmax over all experts, its top 2
    ("phimoe_jitter_window_tied", dict(sparsemixer_eps=None, moe_norm_topk=True)),  # ... renormalised
    ("phimoe_jitter_window_tied", dict(lm_head_bias=False)),
])
def test_granite_and_moe_options_matter(built, name, change):
    """Each Granite multiplier, the top-k renormalisation, OLMoE's clamp and Phi-3.5-MoE's routing, mscales and
    head bias change the logits, so the parity above covers them."""
    v = built(name)
    change = dict(change)
    rope = {k: change.pop(k) for k in list(change) if k in ("short_mscale", "short_factor")}
    config = v.config.replace(**change)
    if rope:
        config = config.replace(rope_scaling=tuple(sorted({**dict(config.rope_scaling), **rope}.items())))
    assert config != v.config
    assert max_valid_diff(jax_logits(config, v.params, v.tokens, v.valid), v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("part", ["shared_expert", "shared_expert_gate"])
def test_qwen2_moe_shared_expert_matters(built, part):
    """Without its shared expert, or with its gate at sigmoid(0) = 1/2, a Qwen2-MoE model computes other logits."""
    v = built("qwen2_moe_shared_random_biases")
    layers, config = dict(v.params["layers"]), v.config
    if part == "shared_expert":
        config = config.replace(shared_expert_intermediate_size=0)
        for k in ("ws_gate", "ws_up", "ws_down", "w_shared_gate"):
            del layers[k]
    else:
        layers["w_shared_gate"] = jnp.zeros_like(layers["w_shared_gate"])
    logits = jax_logits(config, {**v.params, "layers": layers}, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


def _cohere_change(v, change):
    """(config, params) of a Cohere variant with one option changed (the params it then needs derived)."""
    config, layers = v.config, dict(v.params["layers"])
    if change == "parallel_block":  # sequential: the MLP normed anew after the attention's add (same scales)
        config, layers["mlp_norm"] = config.replace(parallel_block=False), layers["attn_norm"]
    elif change == "qk_norm":
        config = config.replace(qk_norm=False, qk_norm_head_scales=False)
        del layers["q_norm"], layers["k_norm"]
    elif change == "qk_norm_full":  # the same scales, but one norm over all heads (OLMo 2's) instead of per head
        config = config.replace(qk_norm_head_scales=False, qk_norm_full=True)
    elif change == "interleaved_rope":  # the checkpoint's q / k layout as it is: rotated by halves, not pairs
        from jaxdecode.models.hf import _to_halves
        back = _to_halves(config, back=True)
        layers.update({k: back(layers[k]) for k in ("wq", "wk", "bq", "bk") if k in layers})
        layers.update({k: {"scale": back(layers[k]["scale"])} for k in ("q_norm", "k_norm") if k in layers})
    elif change == "rope_layers":  # RoPE on every layer, the full ones too
        config = config.replace(rope_layers=())
    elif change == "logit_scale":
        config = config.replace(logit_scale=1.0)
    else:  # RMSNorms: not centred
        config = config.replace(norm_center=False)
    return config, {**v.params, "layers": layers}


@pytest.mark.parametrize("name, change", [
    ("cohere_qk_norm_biases", "logit_scale"), ("cohere_qk_norm_biases", "norm_center"),
    ("cohere_qk_norm_biases", "parallel_block"), ("cohere_qk_norm_biases", "qk_norm"),
    ("cohere_qk_norm_biases", "qk_norm_full"), ("cohere_qk_norm_biases", "interleaved_rope"),
    ("cohere_untied_linear", "interleaved_rope"), ("cohere2_window_nope", "rope_layers"),
    ("cohere2_window_nope", "interleaved_rope"), ("cohere2_window_nope", "logit_scale"),
])
def test_cohere_options_matter(built, name, change):
    """Each Cohere option (its logit_scale, LayerNorm's centring, the parallel block, the per-head query / key
    norms and their scope, the interleaved RoPE layout, Command R7B's RoPE on its sliding layers alone) changes
    the logits, so the parity above covers it."""
    v = built(name)
    config, params = _cohere_change(v, change)
    assert max_valid_diff(jax_logits(config, params, v.tokens, v.valid), v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("part", ["shared_mlp", "sigmoid_gate"])
def test_granitemoeshared_ungated_shared_mlp_matters(built, part):
    """Without its shared MLP, or with Qwen2-MoE's sigmoid gate on it (at sigmoid(0) = 1/2), a Granite-MoE-shared
    model computes other logits: the parity above covers the shared MLP added as it is."""
    v = built("granitemoeshared_tied_llama3")
    layers, config = dict(v.params["layers"]), v.config
    if part == "shared_mlp":
        config = config.replace(shared_expert_intermediate_size=0)
        for k in ("ws_gate", "ws_up", "ws_down"):
            del layers[k]
    else:
        config = config.replace(model_type="qwen2_moe")
        layers["w_shared_gate"] = jnp.zeros(layers["ws_up"].shape[:2] + (1,))
    logits = jax_logits(config, {**v.params, "layers": layers}, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


@pytest.mark.parametrize("change", ["rms_norm", "no_norm_biases"])
def test_phimoe_layer_norms_matter(built, change):
    """Phi-3.5-MoE's LayerNorms: RMSNorms of the same scales, or its LayerNorms without their biases, compute
    other logits, so the parity above covers the mean, the variance and the biases."""
    v = built("phimoe_longrope_biases")
    config, params = v.config, v.params
    if change == "rms_norm":
        config = config.replace(layer_norm=False)
    strip = (lambda n: {"scale": n["scale"]}) if change == "rms_norm" else (
        lambda n: {"scale": n["scale"], "bias": jnp.zeros_like(n["bias"])})
    layers = {k: strip(x) if k.endswith("_norm") else x for k, x in params["layers"].items()}
    params = {**params, "layers": layers, "final_norm": strip(params["final_norm"])}
    assert max_valid_diff(jax_logits(config, params, v.tokens, v.valid), v.logits, v.valid) > 1e-3


def test_sparsemixer_equals_transformers_routing():
    """sparsemixer_top2 equals transformers' sparsemixer (eval mode) on scores with ties, zeros, negatives and
    spreads that keep one or several experts in each masked softmax: the same two experts, the same weights."""
    import torch
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    from jaxdecode.models.transformer import sparsemixer_top2
    rng = np.random.default_rng(0)
    scores = rng.normal(0, 2, (512, 6)).astype(np.float32)
    scores[:64] = np.round(scores[:64])  # ties (the first index wins, in both) and zeros
    scores[64:128] -= 10  # all negative
    scores[128:136] = 0  # every score 0: 0 / 0 in the threshold
    for eps in (0.0, 0.01, 0.1, 0.5, 2.0):
        want_w, want_e = sparsemixer(torch.tensor(scores), jitter_eps=eps, training=False)
        got_w, got_e = sparsemixer_top2(jnp.asarray(scores), eps)
        np.testing.assert_array_equal(np.asarray(got_e), want_e.numpy())
        np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), rtol=1e-6, atol=1e-7)
        assert len(np.unique(np.round(np.asarray(got_w), 4))) > 2  # weights other than 1 (several kept)


def _rows_equal_torch_alone(torch_model, tmp_path):
    """torch_model saved and loaded here; each row of the padded batch equals transformers' forward of that
    sequence alone (LongRoPE picks its factors per sequence). Returns (config, params, tokens, valid, logits)."""
    torch_model.save_pretrained(str(tmp_path))
    config, params = load_params(tmp_path)
    tokens, valid = _batch()
    got = jax_logits(config, params, tokens, valid)
    for row, n in enumerate(BATCH_LENGTHS):
        want = torch_logits(torch_model, tokens[row:row + 1, :n], valid[row:row + 1, :n])[0]
        assert np.abs(got[row, :n] - want).max() <= ATOL, f"row {row}"
    return config, params, tokens, valid, got


def test_phimoe_longrope_past_its_switch_per_row(tmp_path):
    """Past original_max_position_embeddings (8 here) Phi-3.5-MoE rotates with its long factors and cos and sin
    times long_mscale: Microsoft's reference and transformers' PhimoeRotaryEmbedding while it passed the sequence
    length to the LongRoPE init. transformers 5.25 passes none, so its PhimoeForCausalLM keeps the short factors
    (with long_mscale) there; jaxdecode follows the reference: the model compared here is transformers' with that
    length passed. Per row, as for Phi-3: rows of 12 and 9 tokens long, the row of 5 short."""
    torch_model = phimoe_rope_by_length(make_hf_model(
        "phimoe", vocab_size=VOCAB, random_norms=True,
        rope_parameters=dict(PHIMOE_LONGROPE, original_max_position_embeddings=8)))
    config, params, tokens, valid, got = _rows_equal_torch_alone(torch_model, tmp_path)
    for change in (dict(long_factor=tuple(LONGROPE["short_factor"])), dict(long_mscale=1.2)):
        other = jax_logits(config.replace(rope_scaling=tuple(sorted({**dict(config.rope_scaling), **change}.items()))),
                           params, tokens, valid)
        assert np.abs(other[0, :12] - got[0, :12]).max() > 1e-3 and np.abs(other[2, :5] - got[2, :5]).max() == 0


def test_granite_multipliers_round_as_transformers_in_bfloat16():
    """transformers multiplies a bf16 tensor by Granite's Python-float multipliers in float32 and rounds once;
    jnp would round the multiplier to bf16 first. times_float is transformers' product, bit for bit."""
    import torch
    from jaxdecode.models.transformer import times_float
    x = np.random.default_rng(0).normal(0, 4, 4096).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    for m in (0.22, 12.0, 0.0078125, 1 / 3):
        want = (torch.tensor(x).to(torch.bfloat16) * m).float().numpy()
        np.testing.assert_array_equal(np.asarray(times_float(xb, m), np.float32), want)
    assert (np.asarray(xb * 0.22, np.float32) != (torch.tensor(x).to(torch.bfloat16) * 0.22).float().numpy()).any()


def test_cohere_layer_norm_equals_transformers_in_bfloat16(built):
    """CohereLayerNorm centres, normalises and scales in float32, then rounds once: a Cohere model's norm (through
    its config: norm_center, norm_scale_f32) equals it bit for bit in bfloat16; Llama's order (rounded, then
    scaled) does not."""
    import torch
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from jaxdecode.models.transformer import _norm
    config = built("cohere2_window_nope").config
    rng = np.random.default_rng(0)
    x, w = rng.normal(0.5, 3, (64, 256)).astype(np.float32), rng.normal(1, 0.5, 256).astype(np.float32)
    ln = CohereLayerNorm(256, eps=config.norm_eps).to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.copy_(torch.tensor(w))
        want = ln(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    xb, p = jnp.asarray(x, jnp.bfloat16), {"scale": jnp.asarray(w, jnp.bfloat16)}
    np.testing.assert_array_equal(np.asarray(_norm(config, xb, p), np.float32), want)
    llama_order = config.replace(model_type="llama")  # norm_scale_f32 is the layout's: off for Llama
    assert (np.asarray(_norm(llama_order, xb, p), np.float32) != want).any()


def test_longrope_switches_per_row_as_transformers_per_sequence(tmp_path):
    """LongRoPE's factor set is chosen per forward in transformers (long once the sequence passes
    original_max_position_embeddings = 8 here); jaxdecode chooses per row, so in one padded batch the rows of
    12 and 9 tokens take the long factors and the row of 5 the short ones, each as transformers computes that
    sequence alone."""
    torch_model = make_hf_model("phi3", vocab_size=VOCAB, rope_parameters=LONGROPE, original_max_position_embeddings=8)
    config, params, tokens, valid, got = _rows_equal_torch_alone(torch_model, tmp_path)
    # the long factors changed the long rows: the short set alone computes other logits there
    short = config.replace(rope_scaling=tuple(sorted({**dict(config.rope_scaling),
                                                      "long_factor": tuple(LONGROPE["short_factor"])}.items())))
    other = jax_logits(short, params, tokens, valid)
    assert np.abs(other[0, :12] - got[0, :12]).max() > 1e-3 and np.abs(other[2, :5] - got[2, :5]).max() == 0


def test_olmo2_norm_placement_and_scope_matter(built):
    """OLMo 2's norms on the outputs (not the inputs) and its query / key norms over all heads (not per head):
    the same weights placed otherwise compute other logits, so the parity above covers both."""
    v = built("olmo2_post_norms_biases")
    layers = v.params["layers"]
    pre = {k: x for k, x in layers.items() if k not in ("attn_out_norm", "mlp_out_norm")}
    pre.update(attn_norm=layers["attn_out_norm"], mlp_norm=layers["mlp_out_norm"])
    logits = jax_logits(v.config.replace(post_norms=False), {**v.params, "layers": pre}, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3
    per_head = dict(layers, q_norm={"scale": layers["q_norm"]["scale"][:, 0]},
                    k_norm={"scale": layers["k_norm"]["scale"][:, 0]})
    logits = jax_logits(v.config.replace(qk_norm_full=False), {**v.params, "layers": per_head}, v.tokens, v.valid)
    assert max_valid_diff(logits, v.logits, v.valid) > 1e-3


def test_qwen3_query_key_norms_matter(built):
    """Without its per-head query/key norms a Qwen3 model computes other logits, so parity covers them."""
    v = built("qwen3_qk_norm_head_dim16")
    layers = {k: x for k, x in v.params["layers"].items() if k not in ("q_norm", "k_norm")}
    plain = jax_logits(v.config.replace(qk_norm=False), {**v.params, "layers": layers}, v.tokens, v.valid)
    assert max_valid_diff(plain, v.logits, v.valid) > 1e-3


def test_gemma3_vision_language_checkpoint_loads_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (as released: language_model.* tensors beside the
    vision tower's, a text_config listing only what differs from transformers' defaults) loads as its
    text model; its logits on text equal the vision-language model's."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, sliding_window=4, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"], initializer_range=0.2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)).eval()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" in name:
                w.copy_(0.5 * torch.randn_like(w))
    model.save_pretrained(str(tmp_path))
    tokens, valid = _batch()
    tokens = np.minimum(tokens, VOCAB - 4)  # no image tokens
    want = torch_logits(model, tokens, valid)
    config, params = load_params(tmp_path)
    assert config.model_type == "gemma3_text" and config.sliding_windows == (4, 0)
    assert max_valid_diff(jax_logits(config, params, tokens, valid), want, valid) <= ATOL
    # the released form: text_config without the keys at transformers' defaults
    cfg = json.loads((tmp_path / "config.json").read_text())
    defaults = tf.Gemma3TextConfig().to_dict()
    cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if defaults.get(k) != v}
    assert "rms_norm_eps" not in cfg["text_config"] and "hidden_size" in cfg["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sparse_config, sparse_params = load_params(tmp_path)
    assert sparse_config == config
    jax.tree.map(np.testing.assert_array_equal, sparse_params, params)
    del cfg["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model_type 'gemma3' but no text_config object"):
        load_params(tmp_path)


def _to_4x_form(cfg: dict) -> dict:
    """Rewrite a transformers 5.x config.json into the 4.x form (rope_theta/rope_scaling/torch_dtype;
    Gemma: hidden_activation; Gemma 3: rope_local_base_freq, sliding_window_pattern; Command R7B:
    sliding_window_pattern; Phi-3: as released)."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    if cfg["model_type"] == "gemma3_text":
        cfg["rope_local_base_freq"] = rope.pop("sliding_attention")["rope_theta"]
        rope = rope.pop("full_attention")
    if cfg["model_type"] in ("gemma3_text", "cohere2"):  # the released form: a pattern, not the layer types
        types = cfg.pop("layer_types")
        cfg["sliding_window_pattern"] = types.index("full_attention") + 1
        assert types == ["sliding_attention" if (i + 1) % cfg["sliding_window_pattern"] else "full_attention"
                         for i in range(len(types))]
    if cfg["model_type"] == "gemma":
        cfg["hidden_activation"], cfg["hidden_act"] = None, "gelu"  # 4.x: the released configs' form
    if cfg["model_type"] == "gemma2":  # 4.x: even layers slide
        assert cfg.pop("layer_types") == ["sliding_attention", "full_attention"]
    cfg["rope_theta"] = rope.pop("rope_theta")
    if cfg["model_type"] == "phi3":  # the released form: "type", both lengths and the partial factor at the top
        assert rope.pop("partial_rotary_factor") == cfg["partial_rotary_factor"]
        rope.pop("original_max_position_embeddings", None)
        rope["type"] = rope.pop("rope_type")
    if cfg["model_type"] == "phimoe" and rope["rope_type"] == "longrope":  # as released: "type", the lengths in both
        assert rope["original_max_position_embeddings"] == cfg["original_max_position_embeddings"]
        rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] in ("qwen2", "qwen3", "smollm3"):
        cfg.pop("layer_types", None)  # 4.x derives the windowed layers from max_window_layers
    return cfg


@pytest.mark.parametrize("name", ["llama_gqa_untied_llama3", "llama_mha_tied_linear_biases",
                                  "qwen2_window_on_layer1", "qwen3_biases_tied_window", "gemma_mha",
                                  "gemma2_softcaps_window", "gemma3_window_local_rope", "smollm3_window_on_nope",
                                  "mistral_window4", "phi3_partial_window_tied", "phi3_longrope_partial_long",
                                  "olmo2_post_norms_biases", "granite_tied_head_dim16_llama3",
                                  "qwen2_moe_shared_random_biases", "olmoe_raw_topk_clip_biases",
                                  "cohere_qk_norm_biases", "cohere2_window_nope", "granitemoeshared_tied_llama3",
                                  "phimoe_longrope_biases"])
def test_config_json_4x_form_loads_like_5x(built, tmp_path, name):
    v = built(name)
    cfg5 = json.loads((v.dir / "config.json").read_text())
    assert "rope_parameters" in cfg5 and "dtype" in cfg5 and "rope_theta" not in cfg5
    shutil.copytree(v.dir, tmp_path / "4x")
    (tmp_path / "4x" / "config.json").write_text(json.dumps(_to_4x_form(cfg5)))
    config4, params4 = load_params(tmp_path / "4x")
    assert config4 == v.config
    jax.tree.map(np.testing.assert_array_equal, params4, v.params)
    assert max_valid_diff(jax_logits(config4, params4, v.tokens, v.valid), v.torch_logits, v.valid) <= ATOL


@pytest.mark.parametrize("name", ["llama_gqa_untied_llama3", "gpt2_tied"])
def test_sharded_save_pretrained_loads(built, tmp_path, name):
    v = built(name)
    v.torch_model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    config, params = load_params(tmp_path)
    assert config == v.config
    jax.tree.map(np.testing.assert_array_equal, params, v.params)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_params_round_trips_through_transformers(built, tmp_path, name, sharded):
    from transformers import AutoModelForCausalLM
    v = built(name)
    save_params(v.config, v.params, tmp_path, max_shard_bytes=8_000 if sharded else None)
    if sharded:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    else:
        assert (tmp_path / "model.safetensors").exists()
    # Our own loader reads back exactly what we wrote.
    config, params = load_params(tmp_path)
    assert config == v.config
    jax.tree.map(np.testing.assert_array_equal, params, v.params)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(model).__name__ == type(v.torch_model).__name__
    assert max_valid_diff(torch_logits(model, v.tokens, v.valid), v.logits, v.valid) <= ATOL


@pytest.mark.parametrize("name", ["gemma2_softcaps_window", "qwen3_moe_4x2_norm_topk", "phi3_longrope_partial_long",
                                  "olmo3_window_yarn", "qwen2_random_biases", "granite_multipliers_biases",
                                  "qwen2_moe_shared_random_biases", "olmoe_raw_topk_clip_biases",
                                  "cohere_qk_norm_biases", "cohere2_window_nope", "granitemoe_multipliers_biases",
                                  "granitemoeshared_tied_llama3", "phimoe_longrope_biases",
                                  "phimoe_jitter_window_tied"])
def test_weight_only_bfloat16_equals_transformers_on_the_rounded_weights(built, name):
    """load(param_dtype="bfloat16") rounds the weights only: its logits equal transformers' float32 model
    whose weights are rounded the same way (Gemma's embedding scale stays float32; the experts' inputs
    keep float32 precision, as every other matmul's; norm scales stay wide, Cohere's [heads, head_dim] ones too)."""
    import torch
    from jaxdecode.model import narrow_weights
    v = built(name)
    rounded = copy_model = type(v.torch_model)(v.torch_model.config).eval()
    copy_model.load_state_dict(v.torch_model.state_dict())
    with torch.no_grad():
        for p_name, w in rounded.named_parameters():
            if w.ndim >= 2 and "norm" not in p_name:
                w.copy_(w.to(torch.bfloat16).to(torch.float32))
    want = torch_logits(rounded, v.tokens, v.valid)
    got = jax_logits(v.config, narrow_weights(v.params, "bfloat16"), v.tokens, v.valid)
    assert max_valid_diff(got, want, v.valid) <= 1e-4


def test_weight_only_bfloat16_experts_read_their_weights_once(built):
    """Under weight-only bf16 each grouped expert product is ONE ragged_dot (the hi / lo rows of each pair
    stacked), not one per part: three per layer, as in float32."""
    from jaxdecode.model import narrow_weights
    from jaxdecode.models.transformer import moe_mlp
    v = built("qwen3_moe_4x2_norm_topk")
    lp = jax.tree.map(lambda a: a[0], v.params["layers"])
    h = jnp.ones((2, 3, v.config.hidden_size), jnp.float32)
    for params in (lp, narrow_weights(lp, "bfloat16")):
        eqns = jax.make_jaxpr(lambda p: moe_mlp(v.config, h, p))(params).eqns
        assert sum("ragged_dot" in e.primitive.name for e in eqns) == 3


def test_bfloat16_load_runs_close_to_float32(built):
    v = built("llama_gqa_untied_llama3")
    config, params = load_params(v.dir, dtype="bfloat16")
    assert config.dtype == "bfloat16" and config.replace(dtype="float32") == v.config
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(params))
    logits = jax_logits(config, params, v.tokens, v.valid)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    scale = float(np.abs(v.logits[v.valid]).max())
    # bf16 keeps 8 mantissa bits (~0.4% per rounding); a few roundings per layer stay within 5%.
    assert max_valid_diff(logits, v.logits, v.valid) <= 0.05 * max(scale, 1.0)
    # ... and the model still agrees with itself: the f32 argmax is among bf16's top few tokens.
    top3 = np.argsort(-logits, axis=-1)[..., :3]
    hits = (top3 == v.logits.argmax(-1)[..., None]).any(-1)[v.valid]
    assert hits.mean() >= 0.9
