"""Model configuration: one frozen, hashable dataclass for every supported architecture.

The config is a static argument of every jitted function, so it must be hashable: all fields are
scalars, strings or tuples. `from_hf_dict` reads both the transformers 4.x config.json form
(`rope_theta`, `rope_scaling`, `torch_dtype`) and the 5.x form (`rope_parameters`, `dtype`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

# model_type values handled by the llama-family forward (pre-norm, RMSNorm, RoPE, gated MLP); Qwen3, the
# Gemma, the OLMo and the Cohere layouts add the options of _LAYOUT_FLAGS, Phi-3 a partial rotary factor and
# LongRoPE, Granite (dense and MoE) its multipliers, Cohere its logit_scale, Phi-3.5-MoE LayerNorms, an LM-head
# bias, LongRoPE and sparsemixer routing.
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "smollm3", "mixtral",
                "qwen3_moe", "phi3", "olmo2", "olmo3", "granite", "qwen2_moe", "olmoe", "cohere", "cohere2",
                "granitemoe", "granitemoeshared", "phimoe")
# Mixture-of-experts layouts: every layer's MLP is top-k routed experts (Mixtral, Granite-MoE: top-k weights
# always renormalised; Qwen3-MoE, Qwen2-MoE, OLMoE: when norm_topk_prob; Qwen2-MoE: plus a shared expert gated
# by a sigmoid, Granite-MoE-shared: plus an ungated one; Phi-3.5-MoE: sparsemixer's two experts, as they are)
MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "granitemoeshared", "phimoe")
# Granite's multipliers (embedding, residual, attention, logits): the dense layout and the two MoE ones
GRANITE_TYPES = ("granite", "granitemoe", "granitemoeshared")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# Gemma 2 and 3: sandwich norms, query_pre_attn_scalar, sliding-window layers by layer_types, softcaps
_GEMMA_23 = ("gemma2", "gemma3_text")
# OLMo 2 and 3: norms on the attention's and MLP's outputs only, query / key norms over all heads
OLMO_TYPES = ("olmo2", "olmo3")
# Layouts whose sliding-window layers have a RoPE of their own, unscaled (rope_parameters per layer type)
_LOCAL_ROPE_TYPES = ("gemma3_text", "olmo3")
# Command-R (cohere) and Command R7B (cohere2): parallel blocks, LayerNorms without bias, interleaved RoPE (pairs
# (0, 1), (2, 3), ... rotate: the q / k rows are permuted to the half-split layout on load), logits times
# logit_scale; Command R7B's RoPE only on its sliding-window layers, no query / key norms
COHERE_TYPES = ("cohere", "cohere2")
# Layouts whose windows come by layer_types (or every sliding_window_pattern-th layer full), sliding_window 4096
# by default
_LAYER_TYPE_WINDOWS = ("gemma2", "gemma3_text", "olmo3", "cohere2")
# Masked-diffusion LM layouts (llama-family networks without the causal mask), by config.json
# model_type: LLaDA (GSAI-ML/LLaDA-8B-*: its own keys and weight names), Dream (Dream-org/Dream-v0-*:
# Qwen2 keys and weight names, logits shifted by one) and Fast-dLLM v2 (Efficient-Large-Model/
# Fast_dLLM_v2_*: a Qwen2 checkpoint plus `bd_size`, block diffusion with the same shift).
LLADA_TYPE, DREAM_TYPE, FAST_DLLM_TYPE = "llada", "Dream", "Fast_dLLM_Qwen"
DIFFUSION_MODEL_TYPES = (LLADA_TYPE, DREAM_TYPE, FAST_DLLM_TYPE)
SUPPORTED_MODEL_TYPES = (("llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "granite", "gpt2") + GEMMA_TYPES
                         + OLMO_TYPES + MOE_TYPES + COHERE_TYPES + DIFFUSION_MODEL_TYPES)
ATTENTIONS = ("causal", "bidirectional", "block")
# What each diffusion layout implies when its config.json does not say otherwise:
# (attention, logits_shift). Fast-dLLM v2's block size is its config's `bd_size`.
_LAYOUT_DEFAULTS = {LLADA_TYPE: ("bidirectional", 0), DREAM_TYPE: ("bidirectional", 1),
                    FAST_DLLM_TYPE: ("block", 1)}
# The network options a layout implies without a config.json key of its own (all False elsewhere).
_LAYOUT_FLAGS = {"qwen3": dict(qk_norm=True), "qwen3_moe": dict(qk_norm=True),
                 "gemma": dict(norm_plus_one=True, scale_embed=True),
                 "gemma2": dict(norm_plus_one=True, scale_embed=True, sandwich_norms=True),
                 "gemma3_text": dict(qk_norm=True, norm_plus_one=True, scale_embed=True, sandwich_norms=True),
                 "olmo2": dict(post_norms=True, qk_norm=True, qk_norm_full=True),
                 "olmo3": dict(post_norms=True, qk_norm=True, qk_norm_full=True),
                 # OLMoE: OLMo 2's query / key norms over all heads, but Llama's input norms
                 "olmoe": dict(qk_norm=True, qk_norm_full=True),
                 # Cohere: query / key norms (per head, a scale per head) by use_qk_norm, not implied
                 "cohere": dict(parallel_block=True, norm_center=True),
                 "cohere2": dict(parallel_block=True, norm_center=True),
                 "phimoe": dict(layer_norm=True)}
# head_dim when config.json lacks it: transformers' class default for these layouts, not hidden / heads
_HEAD_DIM_DEFAULTS = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}
ROPE_TYPES = ("default", "llama3", "linear", "yarn")
# Phi-3's RoPE (transformers' Phi3Config accepts these alone; its "su" and "yarn" mean longrope); Phi-3.5-MoE's too
PHI3_ROPE_TYPES = ("default", "longrope")
LONGROPE_TYPES = ("phi3", "phimoe")
_NO_ATTENTION_BIAS = ("mistral", "mixtral", "phi3")
_MLP_BIAS_TYPES = ("llama", "smollm3", "granite")
_FLAGS = ("qk_norm", "norm_plus_one", "scale_embed", "sandwich_norms", "post_norms", "qk_norm_full", "parallel_block",
          "norm_center", "qk_norm_head_scales", "layer_norm")
# One sliding window (or none) for every layer: transformers reads no layer_types for these
_ONE_WINDOW_TYPES = ("mixtral", "qwen3_moe", "phi3", "phimoe")
# No sliding window: transformers' attention masks these causally whatever config.json says (OLMoE: only its
# flash-attention path would read a sliding_window, so one is refused at load)
_NO_WINDOW_TYPES = ("olmo2", "olmoe", "cohere") + GRANITE_TYPES
# Granite's multipliers (config.json keys and ModelConfig fields alike) and their neutral values
_GRANITE_MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0}
# Our activation names <-> transformers' (gated MLPs)
_HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


class ConfigError(ValueError):
    """config.json describes a model jaxdecode cannot build."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "llama" | "qwen2" | "qwen3" | "mistral" | "gemma*" | "phi3" | "olmo2" | "olmo3" | "gpt2" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    # llama family
    rope_theta: float = 10000.0
    # rope scaling as a sorted tuple of (key, value) pairs, e.g. (("factor", 8.0), ("rope_type", "llama3"), ...)
    rope_scaling: tuple | None = None
    # RoPE rotates the first int(head_dim * partial_rotary_factor) dims of each head, the rest pass (Phi-4-mini)
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorms scale by 1 + weight, in float32 (Gemma)
    scale_embed: bool = False  # token embeddings times sqrt(hidden_size), in the table's dtype (Gemma)
    sandwich_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs too (Gemma 3)
    post_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs only, none on inputs (OLMo 2)
    # with qk_norm: one RMSNorm over all heads' queries (keys), n_heads * head_dim wide, not one per head (OLMo 2)
    qk_norm_full: bool = False
    # with qk_norm: each head normed over its head_dim as usual, but with a scale of its own ([heads, head_dim]
    # per layer, as OLMo 2's; Cohere)
    qk_norm_head_scales: bool = False
    # the norms subtract the mean first: LayerNorms without bias, scaled in float32 (Cohere's CohereLayerNorm)
    norm_center: bool = False
    # parallel blocks: the attention and the MLP both read the block's one input norm, x + attn(h) + mlp(h), no
    # mlp_norm (Cohere)
    parallel_block: bool = False
    # LayerNorms (mean and variance, a scale and a bias) instead of RMSNorms (Phi-3.5-MoE; GPT-2 has its own path)
    layer_norm: bool = False
    lm_head_bias: bool = False  # the LM head adds a bias [V] (Phi-3.5-MoE's lm_head_bias)
    # attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma 3)
    query_pre_attn_scalar: float | None = None  # as config.json gives it (an int in transformers' schema)
    # RoPE base of the sliding-window layers, unscaled (Gemma 3); None: every layer uses rope_theta
    local_rope_theta: float | None = None
    # c * tanh(x / c) of the attention scores (after scaling) and of the output logits (Gemma 2); None: off
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # per layer, 1 where RoPE applies and 0 where it does not (SmolLM3's NoPE layers); () = every layer
    rope_layers: tuple = ()
    # Mixture of experts (0 experts: a dense MLP): each token's MLP is the weighted sum of its top
    # num_experts_per_tok experts (gated MLPs of width moe_intermediate_size) by the router's softmax,
    # the top weights renormalised to sum to 1 when moe_norm_topk
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_norm_topk: bool = True
    # Phi-3.5-MoE's sparsemixer routing (its inference form, jitter_eps = router_jitter_noise): two experts, each
    # weighted by a softmax over the scores within 2 * eps (relative) of its own; None: the softmax top-k above
    sparsemixer_eps: float | None = None
    # Qwen2-MoE: a shared expert (a gated MLP this wide) beside the routed ones in every layer, its output times
    # sigmoid(h . w_shared_gate); Granite-MoE-shared: its output as it is (shared_expert_gated); 0: none
    shared_expert_intermediate_size: int = 0
    # OLMoE: queries, keys and values clamped to [-clip_qkv, clip_qkv] after the query / key norms; None: off
    clip_qkv: float | None = None
    # Granite: embeddings times embedding_multiplier, each block's attention and MLP outputs times
    # residual_multiplier before their residual add (both in float32, then cast back, as transformers multiplies
    # by a Python float), logits divided by logits_scaling; attention scores scaled by attention_multiplier
    # instead of head_dim ** -0.5 (None: that default)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # Cohere: logits times logit_scale (a multiplier, as transformers multiplies; Granite's logits_scaling divides)
    logit_scale: float = 1.0
    # Per-layer sliding window (0 = full attention); a token at position p sees keys at p' with p - p' < w.
    sliding_windows: tuple = ()
    tie_word_embeddings: bool = False
    activation: str = "silu"  # gated MLP: "silu" | "gelu_tanh" | "gelu" (Gemma); "gelu_new": GPT-2's MLP
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    pad_token_id: int | None = None
    # Anything else from config.json we keep for a faithful save (sorted (key, json-string) pairs).
    extra: tuple = ()
    # Masked-diffusion LMs (defaults = a causal LM). The forward itself does not read these: the
    # attention mask is its argument; decoders and trainers build it from `attention`/`block_size`.
    mask_token_id: int | None = None  # the MASK token of a diffusion LM
    attention: str = "causal"  # "causal" | "bidirectional" (LLaDA, Dream) | "block" (block diffusion:
    #                            causal across blocks of block_size tokens, bidirectional inside)
    block_size: int = 0  # attention == "block": tokens per block (> 0); 0 otherwise
    logits_shift: int = 0  # 1 (Dream, Fast-dLLM v2): the logit at position i predicts token i + 1

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        experts, k = self.num_experts, self.num_experts_per_tok
        if experts and not (0 < k <= experts and self.moe_intermediate_size > 0):
            raise ConfigError(f"a mixture of {self.num_experts} experts needs 1 <= num_experts_per_tok <= "
                              f"{self.num_experts} (got {self.num_experts_per_tok}) and moe_intermediate_size > 0 "
                              f"(got {self.moe_intermediate_size})")
        if self.rope_layers and (len(self.rope_layers) != self.num_layers or not set(self.rope_layers) <= {0, 1}):
            raise ConfigError(f"rope_layers must give 1 (RoPE) or 0 (none) for each of the {self.num_layers} "
                              f"layers, got {self.rope_layers}")
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(
                f"sliding_windows has {len(self.sliding_windows)} entries but the model has "
                f"{self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})")
        if self.qk_norm_full and not self.qk_norm:
            raise ConfigError("qk_norm_full=True (query / key norms over all heads) needs qk_norm=True")
        if self.qk_norm_head_scales and (not self.qk_norm or self.qk_norm_full):
            raise ConfigError("qk_norm_head_scales=True (a query / key norm scale per head) needs qk_norm=True and "
                              "excludes qk_norm_full (one norm over all heads)")
        if self.parallel_block and (self.post_norms or self.sandwich_norms):
            raise ConfigError("parallel_block (attention and MLP read one input norm, Cohere) excludes post_norms "
                              "and sandwich_norms")
        if self.attention_multiplier is not None and self.query_pre_attn_scalar is not None:
            raise ConfigError("attention_multiplier (Granite) and query_pre_attn_scalar (Gemma 2 / 3) both set the "
                              "attention scores' scale; give one")
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise ConfigError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}: a shared "
                              f"expert sits beside routed ones, and this config has num_experts=0")
        for name, value in (*((k, getattr(self, k)) for k in _GRANITE_MULTIPLIERS),
                            ("attention_multiplier", self.attention_multiplier), ("clip_qkv", self.clip_qkv),
                            ("logit_scale", self.logit_scale)):
            if value is not None and not _finite_number(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.logits_scaling == 0:
            raise ConfigError("logits_scaling=0: the logits are divided by it")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ConfigError(f"clip_qkv must be positive (queries, keys and values are clamped to [-clip_qkv, "
                              f"clip_qkv]), got {self.clip_qkv!r}")
        if self.sparsemixer_eps is not None:
            if not _finite_number(self.sparsemixer_eps) or self.sparsemixer_eps < 0:
                raise ConfigError(f"sparsemixer_eps must be a finite number >= 0, got {self.sparsemixer_eps!r}")
            if self.num_experts_per_tok != 2 or self.moe_norm_topk:
                raise ConfigError(f"sparsemixer routing picks two experts and weights them as they are: it needs "
                                  f"num_experts_per_tok=2 and moe_norm_topk=False, got {self.num_experts_per_tok} "
                                  f"and {self.moe_norm_topk}")
        if self.layer_norm and (self.qk_norm or self.norm_plus_one):
            raise ConfigError("layer_norm=True (LayerNorms) with qk_norm or norm_plus_one (RMSNorm options) is not a "
                              "network jaxdecode builds")
        if self.post_norms and self.sandwich_norms:
            raise ConfigError("post_norms (output norms only, OLMo 2) and sandwich_norms (input and output norms, "
                              "Gemma 2 / 3) exclude each other")
        self._check_rope_fields()
        self._check_diffusion_fields()

    def _check_rope_fields(self):
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(f"partial_rotary_factor must be a number in (0, 1], got {f!r}")
        if f != 1 and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(f"partial_rotary_factor={f} gives {self.rotary_dim} rotary dims of head_dim="
                              f"{self.head_dim} (int(head_dim * factor)); jaxdecode's RoPE rotates an even number "
                              f"of them, at least 2")
        sc = self.rope_scaling_dict or {}
        if sc.get("rope_type") != "longrope":
            return
        omax = sc.get("original_max_position_embeddings")
        if isinstance(omax, bool) or not isinstance(omax, (int, np.integer)) or omax < 1:
            raise ConfigError(f"longrope needs original_max_position_embeddings, a positive int, got {omax!r}")
        for key in ("short_factor", "long_factor"):
            v = sc.get(key)
            if (not isinstance(v, tuple) or len(v) != self.rotary_dim // 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v)):
                raise ConfigError(f"longrope's {key} must be a list of {self.rotary_dim // 2} positive numbers (one "
                                  f"per rotary frequency: head_dim {self.head_dim} x partial_rotary_factor "
                                  f"{self.partial_rotary_factor} / 2), got {v!r}")
        for key in ("factor", "attention_factor", "short_mscale", "long_mscale"):
            v = sc.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ConfigError(f"longrope's {key} must be a positive number, got {v!r}")

    def _check_diffusion_fields(self):
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention={self.attention!r} is not one of {ATTENTIONS}")
        if not isinstance(self.block_size, (int, np.integer)) or isinstance(self.block_size, bool):
            raise ConfigError(f"block_size must be an int, got {self.block_size!r}")
        if self.attention == "block" and self.block_size <= 0:
            raise ConfigError(f"attention='block' (block diffusion) needs block_size > 0 tokens per block, "
                              f"got block_size={self.block_size} (config.json: set bd_size)")
        if self.attention != "block" and self.block_size != 0:
            raise ConfigError(f"block_size={self.block_size} is only meaningful with attention='block'; "
                              f"this config has attention={self.attention!r} (set block_size=0 or "
                              f"attention='block')")
        if self.logits_shift not in (0, 1):
            raise ConfigError(f"logits_shift must be 0 or 1, got {self.logits_shift!r}")
        if self.logits_shift and not self.is_diffusion:
            raise ConfigError("logits_shift=1 is for diffusion LMs (attention 'bidirectional' or 'block'); "
                              "a causal LM's logits always predict the next token")
        m = self.mask_token_id
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer))
                              or not 0 <= m < self.vocab_size):
            raise ConfigError(f"mask_token_id={m!r} is not a token id of this model's vocabulary "
                              f"(0 .. {self.vocab_size - 1})")

    @property
    def is_diffusion(self) -> bool:
        """A masked-diffusion LM (bidirectional or block attention), not a causal one."""
        return self.attention != "causal"

    @property
    def is_gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @property
    def uses_rope(self) -> bool:
        return not self.is_gpt2

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[self.dtype]

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones; transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def norm_scale_f32(self) -> bool:
        """RMSNorms multiply by their weight in float32 before the cast back (OLMo 2's order, and Cohere's
        LayerNorm's; Llama's casts first). Only reduced-precision activations see the difference."""
        return self.model_type in OLMO_TYPES + COHERE_TYPES

    @property
    def rope_interleaved(self) -> bool:
        """The checkpoint's RoPE rotates interleaved pairs (0, 1), (2, 3), ... of each head (Cohere), not its
        halves: models.hf permutes the query / key rows (their biases and norm scales) to the half-split layout
        on load, back on save. q . k is the same under one permutation of both, and so are the norms."""
        return self.model_type in COHERE_TYPES

    @property
    def shared_expert_gated(self) -> bool:
        """The shared expert's output is scaled by sigmoid(h . w_shared_gate) (Qwen2-MoE); Granite-MoE-shared's
        dense shared MLP adds its output as it is."""
        return self.model_type != "granitemoeshared"

    @property
    def rope_per_layer(self) -> bool:
        """The layers' RoPE differs (Gemma 3's local base, SmolLM3's layers without RoPE)."""
        return self.local_rope_theta is not None or 0 in self.rope_layers

    @property
    def attn_scale(self) -> float | None:
        """The attention scores' scale when it is not 1/sqrt(head_dim) (None: that default)."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_parameters(self) -> int:
        d, f, v, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        per_head = self.qk_norm_full or self.qk_norm_head_scales
        qk = hd * (self.num_heads + self.num_kv_heads if per_head else 2) if self.qk_norm else 0
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + qk
        mlp = 2 * d * f if self.is_gpt2 else 3 * d * f
        if self.num_experts:
            mlp = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
            fs = self.shared_expert_intermediate_size
            mlp += (3 * fs + int(self.shared_expert_gated)) * d if fs else 0
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        if self.is_gpt2:
            emb += self.max_position_embeddings * d
        return self.num_layers * (attn + mlp) + emb

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported architecture: config.json has model_type={model_type!r} "
                f"(architectures={archs}); jaxdecode supports model_type in {SUPPORTED_MODEL_TYPES}")
        if model_type in _FAMILY_DEFAULT_TYPES:
            cfg = _with_family_defaults(cfg)
        if model_type == LLADA_TYPE:
            base = cls._from_hf_standard(_llada_as_llama(cfg), dtype).replace(extra=_llada_extra(cfg))
        elif model_type in (DREAM_TYPE, FAST_DLLM_TYPE):  # Qwen2 networks and keys
            base = cls._from_hf_standard(dict(cfg, model_type="qwen2"), dtype)
        else:
            base = cls._from_hf_standard(cfg, dtype)
        attention, shift = _LAYOUT_DEFAULTS.get(model_type, ("causal", 0))
        return base.replace(model_type=model_type, mask_token_id=cfg.get("mask_token_id"),
                            attention=cfg.get("diffusion_attention", attention),
                            block_size=cfg.get("bd_size") or 0, logits_shift=cfg.get("logits_shift", shift))

    @classmethod
    def _from_hf_standard(cls, cfg: dict[str, Any], dtype: str | None) -> "ModelConfig":
        """A config.json in the transformers form of one of the causal model types."""
        model_type = cfg.get("model_type")
        src_dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = _normalize_dtype(dtype or src_dtype)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        if model_type == "gpt2":
            d = cfg.get("n_embd", 768)
            n_head = cfg.get("n_head", 12)
            act = cfg.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ConfigError(f"unsupported GPT-2 activation_function={act!r}; expected 'gelu_new'")
            if (cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn")
                    or not cfg.get("scale_attn_weights", True)):
                raise ConfigError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                                  "/ scale_attn_weights=false are not supported (the forward scales "
                                  "attention scores by 1/sqrt(head_dim) only)")
            n_layer = cfg.get("n_layer", 12)
            return cls(
                model_type="gpt2", vocab_size=cfg["vocab_size"], hidden_size=d,
                intermediate_size=cfg.get("n_inner") or 4 * d, num_layers=n_layer,
                num_heads=n_head, num_kv_heads=n_head, head_dim=d // n_head,
                max_position_embeddings=cfg.get("n_positions", 1024),
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5), qkv_bias=True, o_bias=True,
                mlp_bias=True, tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                activation="gelu_new", dtype=dtype, bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids, pad_token_id=cfg.get("pad_token_id"),
                extra=_extra(cfg))
        # llama family
        n_layers = cfg["num_hidden_layers"]
        n_heads = cfg["num_attention_heads"]
        d = cfg["hidden_size"]
        if model_type in GEMMA_TYPES:
            _check_gemma_options(cfg)
        rope_theta, scaling_t, local_theta, partial = _rope(cfg, model_type)
        windows = _sliding_windows(cfg, model_type, n_layers)
        gemma23 = model_type in _GEMMA_23
        qkv_bias_default = model_type == "qwen2"  # Qwen2's attention_bias means q/k/v biases, on by default
        # transformers' Mistral and Mixtral attention has no biases, and only Llama, SmolLM3 and Granite MLPs take
        # one: the keys mean nothing there
        attn_bias = bool(cfg.get("attention_bias", qkv_bias_default)) and model_type not in _NO_ATTENTION_BIAS
        if model_type == "qwen2_moe":  # its q/k/v biases by qkv_bias (on by default); attention_bias is not read
            attn_bias = bool(cfg.get("qkv_bias", True))
        mlp_bias = bool(cfg.get("mlp_bias", False)) and model_type in _MLP_BIAS_TYPES
        cohere = model_type in COHERE_TYPES
        # Command R7B: RoPE on its sliding-window layers alone (transformers rotates where a layer has a window)
        rope_layers = (tuple(int(w > 0) for w in windows) if model_type == "cohere2"
                       else _rope_layers(cfg, model_type, n_layers))
        return cls(
            model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=d,
            intermediate_size=cfg["intermediate_size"], num_layers=n_layers, num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or _HEAD_DIM_DEFAULTS.get(model_type) or d // n_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("layer_norm_eps", 1e-5) if cohere else cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling_t, local_rope_theta=local_theta, partial_rotary_factor=partial,
            qkv_bias=attn_bias, o_bias=attn_bias and model_type not in ("qwen2", "qwen2_moe"), mlp_bias=mlp_bias,
            sliding_windows=windows,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in GEMMA_TYPES + COHERE_TYPES)),
            activation=_activation(cfg, model_type),
            query_pre_attn_scalar=(cfg.get("query_pre_attn_scalar") or 256) if gemma23 else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma23 else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma23 else None,
            rope_layers=rope_layers, **_moe_fields(cfg, model_type, n_layers),
            **_granite_fields(cfg, model_type), **_olmoe_fields(cfg, model_type, d, n_heads),
            **_cohere_fields(cfg, model_type),
            lm_head_bias=bool(cfg.get("lm_head_bias", False)) and model_type == "phimoe",
            dtype=dtype, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"), extra=_extra(cfg, _KNOWN_KEYS | _FAMILY_KEYS.get(model_type, set())),
            **_LAYOUT_FLAGS.get(model_type, {}))

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the transformers 5.x form (4.x readers accept it too: it also has rope_theta);
        a diffusion layout in its own form (LLaDA's keys; Dream / Fast-dLLM v2: Qwen2's plus theirs)."""
        import json
        out = self._to_hf_standard() if self.model_type != LLADA_TYPE else _llada_dict(self)
        # The diffusion fields, where the layout does not already imply them.
        attention, shift = _LAYOUT_DEFAULTS.get(self.model_type, ("causal", 0))
        if self.attention != attention:
            out["diffusion_attention"] = self.attention
        if self.logits_shift != shift:
            out["logits_shift"] = self.logits_shift
        if self.block_size:
            out["bd_size"] = self.block_size
        if self.mask_token_id is not None:
            out["mask_token_id"] = self.mask_token_id
        return json.loads(json.dumps(out))  # plain JSON types (no numpy ints)

    def _to_hf_standard(self) -> dict[str, Any]:
        import json
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.extra}
        eos = (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
               else (self.eos_token_ids[0] if self.eos_token_ids else None))
        common = dict(model_type=self.model_type, vocab_size=self.vocab_size, dtype=self.dtype,
                      torch_dtype=self.dtype, bos_token_id=self.bos_token_id, eos_token_id=eos,
                      pad_token_id=self.pad_token_id, tie_word_embeddings=self.tie_word_embeddings)
        if self.is_gpt2:
            out.update(common, architectures=["GPT2LMHeadModel"], n_embd=self.hidden_size,
                       n_head=self.num_heads, n_layer=self.num_layers, n_inner=self.intermediate_size,
                       n_positions=self.max_position_embeddings, layer_norm_epsilon=self.norm_eps,
                       activation_function="gelu_new")
            return out
        self._check_layout_expresses()
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "granite": "GraniteForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "cohere": "CohereForCausalLM",
                "cohere2": "Cohere2ForCausalLM",
                "granitemoe": "GraniteMoeForCausalLM", "granitemoeshared": "GraniteMoeSharedForCausalLM",
                "phimoe": "PhimoeForCausalLM",
                DREAM_TYPE: "DreamModel", FAST_DLLM_TYPE: "Fast_dLLM_QwenForCausalLM"}[self.model_type]
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dict(self.rope_scaling))
        act = _HF_ACTIVATIONS[self.activation]
        out.update(common, architectures=[arch], hidden_size=self.hidden_size,
                   intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                   num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                   head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                   rms_norm_eps=self.norm_eps, hidden_act=act, rope_parameters=rope,
                   rope_theta=self.rope_theta, mlp_bias=self.mlp_bias)
        if self.model_type in GEMMA_TYPES:  # 4.x Gemma and Gemma 3 read hidden_activation
            out["hidden_activation"] = act
        if self.model_type in _GEMMA_23:
            out.update(query_pre_attn_scalar=self.query_pre_attn_scalar,
                       attn_logit_softcapping=self.attn_logit_softcapping,
                       final_logit_softcapping=self.final_logit_softcapping,
                       layer_types=["sliding_attention" if w else "full_attention" for w in self.sliding_windows],
                       sliding_window=max(self.sliding_windows) or 4096)
        if self.model_type in COHERE_TYPES:  # its LayerNorms' key; rms_norm_eps means nothing there
            del out["rms_norm_eps"]
            out.update(layer_norm_eps=self.norm_eps, logit_scale=self.logit_scale)
            if self.model_type == "cohere":
                out["use_qk_norm"] = self.qk_norm
        if self.model_type in ("olmo3", "cohere2"):
            out.update(layer_types=["sliding_attention" if w else "full_attention" for w in self.sliding_windows],
                       sliding_window=max(self.sliding_windows) or 4096)
        if self.model_type in _LOCAL_ROPE_TYPES:  # 5.x: RoPE per layer type; 4.x (Gemma 3): the local base apart
            out.update(rope_parameters={"full_attention": rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": self.local_rope_theta}})
            if self.model_type == "gemma3_text":
                out["rope_local_base_freq"] = self.local_rope_theta
        if self.model_type == "phi3":  # Phi3Config reads these two at the top level (its own wins there)
            rope["partial_rotary_factor"] = out["partial_rotary_factor"] = self.partial_rotary_factor
            if self.rope_scaling is not None:
                out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        if self.model_type == "smollm3":
            out["no_rope_layers"] = list(self.rope_layers or (1,) * self.num_layers)
        if self.model_type in ("mixtral", "granitemoe", "granitemoeshared", "phimoe"):
            out.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        if self.model_type == "phimoe":  # its pretraining length at the top too, as transformers 4.x reads it
            out.update(router_jitter_noise=self.sparsemixer_eps, lm_head_bias=self.lm_head_bias)
            if self.rope_scaling is not None:
                out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        if self.model_type == "granitemoeshared":
            out["shared_intermediate_size"] = self.shared_expert_intermediate_size
        if self.model_type in ("qwen3_moe", "qwen2_moe"):
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.moe_norm_topk,
                       decoder_sparse_step=1, mlp_only_layers=[])
        if self.model_type == "qwen2_moe":  # its q/k/v biases' key (attention_bias means nothing there)
            out.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size, qkv_bias=self.qkv_bias)
        if self.model_type == "olmoe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       norm_topk_prob=self.moe_norm_topk, clip_qkv=self.clip_qkv)
        if self.model_type in GRANITE_TYPES:
            out.update({k: getattr(self, k) for k in (*_GRANITE_MULTIPLIERS, "attention_multiplier")})
        if self.model_type == "qwen2_moe":
            pass  # its qkv_bias is written above; an o_proj bias is refused by _check_layout_expresses
        elif self.model_type not in _QWEN2_TYPES:
            out["attention_bias"] = self.qkv_bias
        elif self.o_bias:
            raise ConfigError(f"a {self.model_type} config.json cannot express an o_proj bias (Qwen2's "
                              f"attention_bias means q/k/v biases); save this model with model_type 'llama'")
        elif not self.qkv_bias:  # a Qwen2-form layout without q/k/v biases must say so
            out["attention_bias"] = False
        windows = set(self.sliding_windows)
        if len(windows - {0}) > 1:
            raise ConfigError(f"a {self.model_type} config.json has one sliding_window for every windowed layer; "
                              f"this config has several: {sorted(windows - {0})}")
        if self.model_type in LONGROPE_TYPES:  # one window over every layer, or none
            out["sliding_window"] = self.sliding_windows[0] or None
        elif windows != {0} and self.model_type not in _LAYER_TYPE_WINDOWS + OLMO_TYPES:
            if self.model_type == "mistral" and len(windows) == 1:
                out["sliding_window"] = self.sliding_windows[0]
            else:
                w = max(self.sliding_windows)
                out["sliding_window"] = w
                out["use_sliding_window"] = True
                out["layer_types"] = ["sliding_attention" if x else "full_attention"
                                      for x in self.sliding_windows]
        elif self.model_type == "mistral":
            out["sliding_window"] = None
        return out

    def _check_layout_expresses(self):
        """Refuse to save options the model_type's config.json has no way to say (they would load as
        another network)."""
        flags = _LAYOUT_FLAGS.get(self.model_type, {})
        if self.model_type == "cohere":  # use_qk_norm: both on (a scale per head) or both off
            flags = {**flags, "qk_norm": self.qk_norm, "qk_norm_head_scales": self.qk_norm}
        wrong = [f"{f}={getattr(self, f)}" for f in _FLAGS if getattr(self, f) != flags.get(f, False)]
        gemma23 = self.model_type in _GEMMA_23
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None and not gemma23:
                wrong.append(f"{name}={getattr(self, name)}")
        if gemma23 and self.query_pre_attn_scalar is None:
            wrong.append("query_pre_attn_scalar unset (Gemma 2 and 3 always have it)")
        if (self.local_rope_theta is None) == (self.model_type in _LOCAL_ROPE_TYPES):
            wrong.append(f"local_rope_theta={self.local_rope_theta} (Gemma 3 and OLMo 3 alone have it)")
        rope_type = (self.rope_scaling_dict or {}).get("rope_type", "default")
        if self.model_type == "phi3" and rope_type not in PHI3_ROPE_TYPES:
            wrong.append(f"rope_type={rope_type!r} (Phi-3's RoPE is {' or '.join(PHI3_ROPE_TYPES)})")
        if self.model_type == "phimoe" and rope_type not in PHI3_ROPE_TYPES:
            wrong.append(f"rope_type={rope_type!r} (Phi-3.5-MoE's RoPE is {' or '.join(PHI3_ROPE_TYPES)})")
        if (self.model_type not in LONGROPE_TYPES and rope_type == "longrope"
                or self.model_type != "phi3" and self.partial_rotary_factor != 1):
            wrong.append(f"rope_type={rope_type!r}, partial_rotary_factor={self.partial_rotary_factor} (longrope "
                         f"is Phi-3's and Phi-3.5-MoE's alone, a partial rotary factor Phi-3's alone)")
        sc = self.rope_scaling_dict or {}
        mscales = {k for k in ("short_mscale", "long_mscale") if sc.get(k) is not None}
        if rope_type == "longrope" and (self.model_type == "phimoe") != (len(mscales) == 2):
            wrong.append(f"longrope with {sorted(mscales) or 'no'} mscales (Phi-3.5-MoE's longrope has both "
                         f"short_mscale and long_mscale, Phi-3's neither)")
        if self.model_type == "phimoe" and (sc.keys() & {"factor", "attention_factor"}):
            wrong.append("longrope factor / attention_factor (Phi-3.5-MoE's mscales set its attention factor)")
        if (self.sparsemixer_eps is not None) != (self.model_type == "phimoe"):
            wrong.append(f"sparsemixer_eps={self.sparsemixer_eps} (Phi-3.5-MoE alone routes by sparsemixer, always)")
        if self.lm_head_bias and self.model_type != "phimoe":
            wrong.append("lm_head_bias=True (Phi-3.5-MoE alone has an LM-head bias)")
        if self.model_type in _NO_WINDOW_TYPES and set(self.sliding_windows) != {0}:
            name = {"olmo2": "OLMo 2", "olmoe": "OLMoE", "cohere": "Command-R"}.get(self.model_type, "Granite")
            wrong.append(f"sliding_windows={self.sliding_windows} ({name} has no sliding window)")
        granite = self.model_type in GRANITE_TYPES
        for name, neutral in _GRANITE_MULTIPLIERS.items():
            if getattr(self, name) != neutral and not granite:
                wrong.append(f"{name}={getattr(self, name)} (Granite alone has it)")
        if self.logit_scale != 1.0 and self.model_type not in COHERE_TYPES:
            wrong.append(f"logit_scale={self.logit_scale} (Command-R and Command R7B alone have it)")
        if (self.attention_multiplier is None) == granite:
            wrong.append(f"attention_multiplier={self.attention_multiplier} (Granite alone has it, always)")
        shared = self.shared_expert_intermediate_size
        if (shared > 0) != (self.model_type == "qwen2_moe") and self.model_type != "granitemoeshared":
            wrong.append(f"shared_expert_intermediate_size={shared} (Qwen2-MoE alone has a shared expert, always; "
                         f"Granite-MoE-shared an optional one)")
        if self.clip_qkv is not None and self.model_type != "olmoe":
            wrong.append(f"clip_qkv={self.clip_qkv} (OLMoE alone has it)")
        if self.activation not in _HF_ACTIVATIONS:
            wrong.append(f"activation={self.activation!r}")
        if self.model_type in _NO_ATTENTION_BIAS and (self.qkv_bias or self.o_bias):
            wrong.append("attention biases (transformers' Mistral and Mixtral attention has none)")
        elif self.model_type == "qwen2_moe" and self.o_bias:
            wrong.append("o_bias=True (Qwen2-MoE's o_proj has no bias; qkv_bias sets the q/k/v ones)")
        elif self.model_type not in _QWEN2_TYPES + ("qwen2_moe",) and self.qkv_bias != self.o_bias:
            wrong.append(f"qkv_bias={self.qkv_bias} with o_bias={self.o_bias} (attention_bias sets both)")
        if self.mlp_bias and self.model_type not in _MLP_BIAS_TYPES:
            wrong.append(f"mlp_bias=True (only {', '.join(_MLP_BIAS_TYPES)} MLPs take one)")
        if self.model_type in _ONE_WINDOW_TYPES and len(set(self.sliding_windows)) > 1:
            wrong.append(f"sliding_windows={self.sliding_windows} (one window for every layer in this layout)")
        if (self.num_experts > 0) != (self.model_type in MOE_TYPES):
            wrong.append(f"num_experts={self.num_experts} (the mixture-of-experts layouts: {', '.join(MOE_TYPES)})")
        elif self.model_type in ("mixtral", "granitemoe", "granitemoeshared") and not (
                self.moe_norm_topk and self.moe_intermediate_size == self.intermediate_size):
            wrong.append("moe_norm_topk=False or experts narrower than intermediate_size (Mixtral and Granite-MoE "
                         "renormalise, their experts are intermediate_size wide)")
        elif self.model_type == "olmoe" and self.moe_intermediate_size != self.intermediate_size:
            wrong.append(f"moe_intermediate_size={self.moe_intermediate_size} (OLMoE's experts are intermediate_size "
                         f"wide, {self.intermediate_size})")
        if self.model_type == "olmoe" and self.head_dim * self.num_heads != self.hidden_size:
            wrong.append(f"head_dim={self.head_dim} (OLMoE's is hidden_size // num_attention_heads)")
        if self.model_type == "cohere2":  # layer_types says both the windows and where RoPE is
            want = tuple(int(w > 0) for w in self.sliding_windows)
            if (self.rope_layers or (1,) * self.num_layers) != want:
                wrong.append(f"rope_layers={self.rope_layers} (Command R7B's RoPE is on its sliding-window layers "
                             f"alone: {want})")
        elif 0 in self.rope_layers and self.model_type != "smollm3":
            wrong.append(f"rope_layers={self.rope_layers} (SmolLM3 alone has layers without RoPE)")
        if wrong:
            layouts = "; ".join(f"{t}: {', '.join(f)}" for t, f in _LAYOUT_FLAGS.items())
            raise ConfigError(f"a {self.model_type} config.json cannot express {', '.join(wrong)} (the layouts "
                              f"that imply these options: {layouts}); save with the model_type whose "
                              f"network this is")


_QWEN2_TYPES = ("qwen2", DREAM_TYPE, FAST_DLLM_TYPE)


def _finite_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _normalize_dtype(name: str) -> str:
    name = str(name).replace("torch.", "")
    aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
               "fp16": "float16", "auto": "float32"}
    name = aliases.get(name, name)
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return name


# Layouts whose transformers config class assumes its own values for keys a config.json leaves out (Gemma
# 2's soft-caps 50 / 30, Mixtral's rope_theta 1e6 and rms_norm_eps 1e-5, SmolLM3's rope_theta 2e6 and tied
# embeddings, ...): those values are read from the class, as transformers reads the file.
_FAMILY_DEFAULT_TYPES = ("qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text", "smollm3", "phi3",
                         "olmo2", "olmo3", "qwen2_moe", "olmoe", "cohere", "cohere2", "phimoe") + GRANITE_TYPES


def _with_family_defaults(cfg: dict) -> dict:
    """cfg completed with its transformers config class's values for the keys it lacks (cfg's own win);
    cfg as it is without transformers, or when the class refuses it (the checks here then name what is
    wrong, in this library's terms)."""
    try:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging
    except ImportError:
        return cfg
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on defaults (ids past a tiny vocabulary) are not ours
    try:
        full = AutoConfig.for_model(**cfg).to_dict()
    except Exception:  # noqa: BLE001 (transformers' validation errors have no common base)
        return cfg
    finally:
        hf_logging.set_verbosity(level)
    return {**full, **cfg}


def _check_gemma_options(cfg: dict) -> None:
    """Gemma options whose network differs from the one the forward computes are refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = cfg.get(key)
        if cap is not None and (cfg.get("model_type") not in _GEMMA_23 or isinstance(cap, bool)
                                or not isinstance(cap, (int, float)) or not 0 < cap < float("inf")):
            raise ConfigError(f"unsupported {cfg.get('model_type')} option {key}={cap!r}: soft-capping takes a "
                              f"positive number, in a Gemma 2 or Gemma 3 config.json")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true (EmbeddingGemma, an encoder) is not a causal LM; "
                          "jaxdecode decodes causal Gemma models")


def _activation(cfg: dict, model_type: str) -> str:
    """The gated MLP's activation, by our name."""
    if model_type == "gemma":  # 4.x reads hidden_activation, 5.x hidden_act; the released "gelu" is tanh's
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    elif model_type in _GEMMA_23:
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        act = cfg.get("hidden_act", "silu")
    ours = {hf: name for name, hf in _HF_ACTIVATIONS.items()}
    if act not in ours:
        raise ConfigError(f"unsupported hidden_act={act!r}; the gated MLP implements {sorted(ours)}")
    return ours[act]


def _rope(cfg: dict, model_type: str) -> tuple:
    """(rope_theta, rope scaling as sorted pairs or None, the sliding layers' theta or None, partial rotary
    factor) from either config.json form. Gemma 3's and OLMo 3's sliding-window layers use an unscaled RoPE of
    their own base."""
    params = dict(cfg.get("rope_parameters") or {})
    local_theta = None
    if model_type in _LOCAL_ROPE_TYPES:
        name = {"gemma3_text": "Gemma 3", "olmo3": "OLMo 3"}[model_type]
        if "full_attention" in params or "sliding_attention" in params:  # 5.x: one set per layer type
            local = dict(params.get("sliding_attention") or {})
            params = dict(params.get("full_attention") or {})
        else:  # 4.x: rope_theta and rope_scaling for the full layers, rope_local_base_freq (Gemma 3)
            local = {}
        if model_type == "gemma3_text":
            params.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
            local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
        else:  # Olmo3Config gives the 4.x rope_theta to the full layers only: the sliding ones keep its 500000
            params.setdefault("rope_theta", cfg.get("rope_theta", 500_000.0))
            local_theta = float(local.get("rope_theta", 500_000.0))
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ConfigError(f"unsupported rope_type={local.get('rope_type', local.get('type'))!r} for {name}'s "
                              f"sliding-window layers; supported: default")
    rope_theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    if model_type == "phi3":
        return (rope_theta, *_phi3_rope(cfg, scaling))
    if model_type == "phimoe":
        return rope_theta, _phimoe_rope(cfg, scaling), None, 1.0
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"unsupported rope_type={rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    factor = scaling.get("factor")
    if rope_type in ("linear", "llama3") or (rope_type == "yarn" and "factor" not in scaling):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"rope_type={rope_type!r} needs a positive 'factor' in config.json's rope scaling, "
                              f"got {factor!r}")
    if rope_type in ("llama3", "yarn"):  # as transformers: the pretraining length defaults to the model's
        scaling.setdefault("original_max_position_embeddings",
                           cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048))
    if rope_type == "yarn":
        if scaling.get("factor") is None:  # DeepSeek-V3's form: the ratio of the two lengths
            scaling["factor"] = cfg.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
        scaling = {k: v for k, v in scaling.items() if v is not None}
    return rope_theta, None if rope_type == "default" else tuple(sorted(scaling.items())), local_theta, 1.0


def _phi3_rope(cfg: dict, scaling: dict) -> tuple:
    """Phi-3's rope scaling (default or longrope), local theta (None) and partial rotary factor, read as
    transformers' Phi3Config reads them: the factor from rope_parameters, else the top-level key; the
    pretraining length from the top-level original_max_position_embeddings (4096 when absent), which
    wins over rope_parameters'; "su" and "yarn" are longrope's old names."""
    scaling.pop("type", None)  # transformers' normalised dict keeps the old name beside rope_type
    partial = scaling.pop("partial_rotary_factor", None)
    partial = cfg.get("partial_rotary_factor", 1.0) if partial is None else partial
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"unsupported partial_rotary_factor={partial!r}; it takes a number in (0, 1]")
    rope_type = scaling.get("rope_type", "default")
    if rope_type in ("su", "yarn"):
        rope_type = scaling["rope_type"] = "longrope"
    if rope_type not in PHI3_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_type={rope_type!r} for phi3; supported: {', '.join(PHI3_ROPE_TYPES)}")
    if rope_type == "default":
        return None, None, float(partial)
    omax = cfg.get("original_max_position_embeddings", 4096)
    scaling = {k: v for k, v in scaling.items() if v is not None}
    scaling["original_max_position_embeddings"] = omax
    unknown = sorted(set(scaling) - {"rope_type", "short_factor", "long_factor", "original_max_position_embeddings",
                                     "factor", "attention_factor"})
    if unknown:
        raise ConfigError(f"unsupported longrope keys {unknown} in config.json's rope scaling; jaxdecode reads "
                          f"short_factor, long_factor, factor, attention_factor and original_max_position_embeddings")
    _longrope_factor_tuples(scaling)
    return tuple(sorted(scaling.items())), None, float(partial)


def _longrope_factor_tuples(scaling: dict) -> None:
    """LongRoPE's short / long factor lists, checked and made tuples in place (hashable: the config is a static
    argument of the jitted forward)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ConfigError(f"longrope needs {key}, a list of numbers, in config.json's rope scaling; got "
                              f"{scaling.get(key)!r}")
        scaling[key] = tuple(scaling[key])


def _phimoe_rope(cfg: dict, scaling: dict) -> tuple | None:
    """Phi-3.5-MoE's rope scaling (None or longrope) as transformers 5's PhimoeConfig reads it: the pretraining
    length from rope_parameters (max_position_embeddings when absent), cos and sin times short_mscale / long_mscale
    (both required). Its factor sets follow Phi-3's: the short ones, then the long ones for a sequence past the
    pretraining length (see README: transformers 5.25 keeps the short ones there)."""
    scaling.pop("type", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in PHI3_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_type={rope_type!r} for phimoe; supported: {', '.join(PHI3_ROPE_TYPES)}")
    partial = scaling.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"unsupported phimoe partial_rotary_factor={partial!r}: Phi-3.5-MoE rotates whole heads")
    if rope_type == "default":
        return None
    scaling = {k: v for k, v in scaling.items() if v is not None}
    scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 131072))
    top = cfg.get("original_max_position_embeddings")
    if top is not None and top != scaling["original_max_position_embeddings"]:  # 4.x switches factors by this one
        raise ConfigError(f"this phimoe config.json has original_max_position_embeddings={top!r} at the top level but "
                          f"{scaling['original_max_position_embeddings']!r} in its rope scaling: transformers 4.x and "
                          f"5.x would switch its LongRoPE at different lengths; make them equal")
    unknown = sorted(set(scaling) - {"rope_type", "short_factor", "long_factor", "short_mscale", "long_mscale",
                                     "original_max_position_embeddings"})
    if unknown:
        raise ConfigError(f"unsupported phimoe longrope keys {unknown} in config.json's rope scaling; jaxdecode reads "
                          f"short_factor, long_factor, short_mscale, long_mscale and original_max_position_embeddings")
    _longrope_factor_tuples(scaling)
    for key in ("short_mscale", "long_mscale"):  # transformers' PhimoeConfig refuses a longrope without them
        if not _finite_number(scaling.get(key)):
            raise ConfigError(f"phimoe's longrope needs {key}, a number, in config.json's rope scaling; got "
                              f"{scaling.get(key)!r}")
    return tuple(sorted(scaling.items()))


def _moe_fields(cfg: dict, model_type: str, n_layers: int) -> dict:
    """The mixture-of-experts fields of a Mixtral / Qwen3-MoE / Qwen2-MoE / OLMoE config.json ({} for a dense
    layout). The fallbacks are the config classes' defaults (`_with_family_defaults` fills them in first)."""
    if model_type not in MOE_TYPES:
        return {}
    experts = cfg.get("num_local_experts") if model_type == "mixtral" else (
        cfg.get("num_experts") or cfg.get("num_local_experts"))
    if model_type == "mixtral":
        return dict(num_experts=experts or 8, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], moe_norm_topk=True)
    if model_type in GRANITE_TYPES:
        return _granite_moe_fields(cfg, model_type)
    if model_type == "phimoe":  # sparsemixer: always two experts of intermediate_size, weights as they come
        experts, k, eps = cfg.get("num_local_experts", 16), cfg.get("num_experts_per_tok", 2), cfg.get(
            "router_jitter_noise", 0.01)
        if k != 2:
            raise ConfigError(f"unsupported phimoe num_experts_per_tok={k!r}: transformers' sparsemixer routes every "
                              f"token to two experts whatever it says, so jaxdecode loads Phi-3.5-MoE with 2")
        if not _finite_number(eps) or eps < 0:
            raise ConfigError(f"unsupported phimoe router_jitter_noise={eps!r}; it takes a number >= 0")
        return dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=cfg["intermediate_size"],
                    moe_norm_topk=False, sparsemixer_eps=float(eps))
    if model_type == "olmoe":  # its experts are intermediate_size wide, as Mixtral's
        if cfg.get("num_experts") == 0:
            raise ConfigError("this olmoe config.json has num_experts=0; jaxdecode loads OLMoE with experts in every "
                              "layer, as transformers builds it")
        return dict(num_experts=experts or 64, num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
                    moe_intermediate_size=cfg["intermediate_size"],
                    moe_norm_topk=bool(cfg.get("norm_topk_prob", False)))
    step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    sparse = [i for i in range(n_layers) if i not in dense and step and (i + 1) % step == 0]
    released = "Qwen3-MoE" if model_type == "qwen3_moe" else "Qwen1.5-MoE / Qwen2-MoE"
    if len(sparse) != n_layers or cfg.get("num_experts") == 0:
        why = "num_experts=0" if cfg.get("num_experts") == 0 else f"decoder_sparse_step={step}, mlp_only_layers={dense}"
        raise ConfigError(f"this {model_type} config.json has dense MLP layers ({why}); jaxdecode loads "
                          f"mixture-of-experts models whose every layer has experts (as the released {released} "
                          f"models)")
    if model_type == "qwen3_moe":
        return dict(num_experts=experts or 128, num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
                    moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
                    moe_norm_topk=bool(cfg.get("norm_topk_prob", False)))
    shared = cfg.get("shared_expert_intermediate_size", 5632)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared <= 0:
        raise ConfigError(f"unsupported qwen2_moe shared_expert_intermediate_size={shared!r}; jaxdecode's "
                          f"Qwen2-MoE has a shared expert of a positive width in every layer")
    return dict(num_experts=experts or 60, num_experts_per_tok=cfg.get("num_experts_per_tok", 4),
                moe_intermediate_size=cfg.get("moe_intermediate_size", 1408),
                moe_norm_topk=bool(cfg.get("norm_topk_prob", False)), shared_expert_intermediate_size=shared)


def _granite_moe_fields(cfg: dict, model_type: str) -> dict:
    """Granite-MoE's experts: num_local_experts of intermediate_size, the top k by the router's logits weighted by
    a softmax over those k (the same weights as renormalising the top k of a softmax over all: moe_norm_topk);
    Granite-MoE-shared's dense shared MLP of shared_intermediate_size beside them (0: none, as transformers)."""
    experts, shared = cfg.get("num_local_experts", 8), cfg.get("shared_intermediate_size", 0)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ConfigError(f"unsupported {model_type} num_local_experts={experts!r}; jaxdecode loads Granite-MoE with "
                          f"experts in every layer (a positive count)")
    if model_type == "granitemoeshared" and (isinstance(shared, bool) or not isinstance(shared, int) or shared < 0):
        raise ConfigError(f"unsupported granitemoeshared shared_intermediate_size={shared!r}; it takes a width >= 0 "
                          f"(0: no shared MLP)")
    return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                moe_intermediate_size=cfg["intermediate_size"], moe_norm_topk=True,
                shared_expert_intermediate_size=shared if model_type == "granitemoeshared" else 0)


def _granite_fields(cfg: dict, model_type: str) -> dict:
    """Granite's multipliers (transformers' defaults, 1, for keys left out); {} for the other layouts."""
    if model_type not in GRANITE_TYPES:
        return {}
    out = {k: cfg.get(k, v) for k, v in _GRANITE_MULTIPLIERS.items()}
    out["attention_multiplier"] = cfg.get("attention_multiplier", 1.0)
    for key, value in out.items():
        if not _finite_number(value) or (key == "logits_scaling" and value == 0):
            raise ConfigError(f"unsupported {model_type} {key}={value!r}; it takes a finite number"
                              + (" other than 0" if key == "logits_scaling" else ""))
    return {k: float(v) for k, v in out.items()}


def _olmoe_fields(cfg: dict, model_type: str, d: int, n_heads: int) -> dict:
    """OLMoE's clip_qkv; its query / key norms span hidden_size, so head_dim must be hidden_size // heads."""
    if model_type != "olmoe":
        return {}
    if cfg.get("head_dim") not in (None, d // n_heads):
        raise ConfigError(f"unsupported olmoe head_dim={cfg['head_dim']!r}: transformers' OLMoE norms the queries "
                          f"over hidden_size ({d}), so its head_dim is hidden_size // num_attention_heads "
                          f"({d // n_heads})")
    clip = cfg.get("clip_qkv")
    if clip is not None and (not _finite_number(clip) or clip <= 0):
        raise ConfigError(f"unsupported olmoe clip_qkv={clip!r}; it takes a positive number (or null: no clamp)")
    return dict(clip_qkv=None if clip is None else float(clip))


def _cohere_fields(cfg: dict, model_type: str) -> dict:
    """Command-R's logit_scale (0.0625 when left out, as transformers) and its query / key norms (use_qk_norm: a
    scale per head); Command R7B's logit_scale (its attention reads no use_qk_norm); {} for the other layouts."""
    if model_type not in COHERE_TYPES:
        return {}
    scale = cfg.get("logit_scale", 0.0625)
    if not _finite_number(scale):
        raise ConfigError(f"unsupported {model_type} logit_scale={scale!r}; it takes a finite number (the logits are "
                          f"multiplied by it)")
    out = dict(logit_scale=float(scale))
    if model_type == "cohere" and cfg.get("use_qk_norm"):
        out.update(qk_norm=True, qk_norm_head_scales=True)
    return out


def _rope_layers(cfg: dict, model_type: str, n_layers: int) -> tuple:
    """SmolLM3's no_rope_layers (1: RoPE), or every no_rope_layer_interval-th layer without; () elsewhere."""
    if model_type != "smollm3":
        return ()
    layers = cfg.get("no_rope_layers")
    if layers is None:
        interval = cfg.get("no_rope_layer_interval") or 4
        layers = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(layers, list) or len(layers) != n_layers or not set(layers) <= {0, 1}:
        raise ConfigError(f"config.json's no_rope_layers must be a list of 0 / 1 for the {n_layers} layers, "
                          f"got {layers!r}")
    return tuple(int(x) for x in layers)


# Dense Qwen layouts: a window only with use_sliding_window, on the layers from max_window_layers on
_QWEN_WINDOWS = ("qwen2", "qwen3")


def _sliding_windows(cfg: dict, model_type: str, n_layers: int) -> tuple:
    window = cfg.get("sliding_window")
    unknown = sorted(set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"config.json's layer_types has {unknown}; jaxdecode builds full_attention and "
                          f"sliding_attention layers")
    if model_type == "olmoe" and window is not None:
        raise ConfigError(f"unsupported olmoe sliding_window={window!r}: transformers' OLMoE windows its attention "
                          f"on its flash-attention path only (eager and SDPA attend to every key); jaxdecode "
                          f"loads OLMoE without a window (remove the key)")
    if model_type in _NO_WINDOW_TYPES:  # transformers' OLMo 2 and Granite read neither key
        return (0,) * n_layers
    if model_type == "qwen2_moe":
        return _qwen2_moe_windows(cfg, window, n_layers)
    if model_type in _ONE_WINDOW_TYPES:  # one window for every layer (transformers reads no layer_types)
        on = bool(window) and (model_type != "qwen3_moe" or cfg.get("use_sliding_window", False))
        return (int(window) if on else 0,) * n_layers
    if model_type in _LAYER_TYPE_WINDOWS:  # layer_types, or (older configs) every pattern-th layer full
        window = cfg.get("sliding_window", 4096)  # transformers' default when the key is absent
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (
            {"gemma3_text": 6, "olmo3": 4, "cohere2": 4}.get(model_type, 2))
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(n_layers)]
        if "sliding_attention" in types and not window:
            raise ConfigError(f"config.json's layer_types has sliding-attention layers but sliding_window is "
                              f"{window!r}; set it (Gemma 2 and 3: 4096, or 512 / 1024; Command R7B: 4096; "
                              f"OLMo 3: 4096)")
        if len(types) != n_layers:
            raise ConfigError(f"config.json's layer_types has {len(types)} entries for {n_layers} layers")
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    if not window:
        return (0,) * n_layers
    layer_types = cfg.get("layer_types")
    if model_type in _QWEN_WINDOWS + ("smollm3",) and not cfg.get("use_sliding_window", False):
        return (0,) * n_layers
    if model_type == "smollm3" and not layer_types:  # the layers without RoPE slide
        return tuple(0 if rope else int(window) for rope in _rope_layers(cfg, model_type, n_layers))
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if model_type in _QWEN_WINDOWS:
        # transformers 4.x semantics: layers >= max_window_layers use the window.
        mwl = cfg.get("max_window_layers", n_layers)
        return tuple(int(window) if i >= mwl else 0 for i in range(n_layers))
    return (int(window),) * n_layers


def _qwen2_moe_windows(cfg: dict, window, n_layers: int) -> tuple:
    """Qwen2-MoE's windows as transformers 5 reads them: with use_sliding_window, the layers layer_types calls
    sliding (by default the even ones below max_window_layers) see sliding_window keys; without it, none."""
    types = cfg.get("layer_types")
    if not cfg.get("use_sliding_window", False):
        if types and "sliding_attention" in types:  # transformers' window is then 0: such a layer sees no key
            raise ConfigError("this qwen2_moe config.json's layer_types has sliding-attention layers but "
                              "use_sliding_window is false (transformers then masks every key of those layers); "
                              "set use_sliding_window, or make every layer full_attention")
        return (0,) * n_layers
    if not window:
        raise ConfigError(f"this qwen2_moe config.json sets use_sliding_window but sliding_window is {window!r}")
    mwl = cfg.get("max_window_layers", 28)
    types = types or ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise ConfigError(f"config.json's layer_types has {len(types)} entries for {n_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


_KNOWN_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
    "sliding_window", "use_sliding_window", "layer_types", "max_window_layers", "tie_word_embeddings",
    "hidden_act", "dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "architectures", "n_embd", "n_head", "n_layer", "n_inner", "n_positions", "layer_norm_epsilon",
    "activation_function", "transformers_version", "mask_token_id", "diffusion_attention", "bd_size",
    "logits_shift", "hidden_activation", "query_pre_attn_scalar", "rope_local_base_freq",
    "sliding_window_pattern", "_sliding_window_pattern", "attn_logit_softcapping", "final_logit_softcapping",
    "use_bidirectional_attention", "no_rope_layers", "no_rope_layer_interval", "num_local_experts", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
}
# Keys a layout's own ModelConfig fields carry (elsewhere they stay in `extra`, as config.json said them)
_GRANITE_KEYS = {*_GRANITE_MULTIPLIERS, "attention_multiplier"}
_FAMILY_KEYS = {"phi3": {"partial_rotary_factor"}, "granite": _GRANITE_KEYS, "granitemoe": _GRANITE_KEYS,
                "granitemoeshared": _GRANITE_KEYS | {"shared_intermediate_size"},
                "qwen2_moe": {"shared_expert_intermediate_size", "qkv_bias"}, "olmoe": {"clip_qkv"},
                "cohere": {"logit_scale", "layer_norm_eps", "use_qk_norm"},
                "cohere2": {"logit_scale", "layer_norm_eps"},
                "phimoe": {"router_jitter_noise", "lm_head_bias", "original_max_position_embeddings"}}


def _extra(cfg: dict, known=_KNOWN_KEYS) -> tuple:
    import json
    return tuple(sorted((k, json.dumps(v)) for k, v in cfg.items() if k not in known))


# ----------------------------------------------------------------------------- LLaDA's config.json
# LLaDA (GSAI-ML/LLaDA-8B-Base / -Instruct, configuration_llada.py) keeps OLMo's config keys. Its
# forward is the llama family's when these options hold (they do in the released checkpoints); a
# config.json that lacks one or sets it otherwise is refused, since its network would differ.
_LLADA_REQUIRED = {"block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
                   "include_bias": False}
# Options that must be off (or at their neutral value) when present.
_LLADA_NEUTRAL = {"alibi": False, "input_emb_norm": False, "scale_logits": False, "attention_layer_norm": False,
                  "block_group_size": 1, "layer_norm_with_affine": True, "bias_for_layer_norm": False}
# Keys whose meaning the ModelConfig fields carry (the others round-trip through `extra`; so does
# vocab_size, the tokenizer's size, which may be below embedding_size = our vocab_size).
_LLADA_KEYS = {"model_type", "architectures", "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_ratio",
               "mlp_hidden_size", "max_sequence_length", "embedding_size", "weight_tying",
               "include_qkv_bias", "multi_query_attention", "rms_norm_eps", "rope_theta", "eos_token_id",
               "pad_token_id", "bos_token_id", "torch_dtype", "dtype", "mask_token_id", "diffusion_attention",
               "bd_size", "logits_shift", "transformers_version", *_LLADA_REQUIRED, *_LLADA_NEUTRAL}


def _llada_extra(cfg: dict) -> tuple:
    # vocab_size is kept only where it differs from embedding_size (our vocab_size).
    same = cfg.get("embedding_size") in (None, cfg.get("vocab_size"))
    return _extra(cfg, _LLADA_KEYS | ({"vocab_size"} if same else set()))


def _llada_as_llama(cfg: dict) -> dict:
    """LLaDA's config.json -> the llama form `_from_hf_standard` reads (errors name LLaDA's keys)."""
    for key, want in _LLADA_REQUIRED.items():
        if key not in cfg:
            raise ConfigError(f"a LLaDA config.json must set {key!r} (jaxdecode's LLaDA forward is the one "
                              f"with {key}={want!r}, as in GSAI-ML/LLaDA-8B)")
        if cfg[key] != want:
            raise ConfigError(f"unsupported LLaDA option {key}={cfg[key]!r}; jaxdecode's LLaDA forward "
                              f"implements {key}={want!r} (as in GSAI-ML/LLaDA-8B)")
    for key, want in _LLADA_NEUTRAL.items():
        if cfg.get(key) not in (None, want):
            raise ConfigError(f"unsupported LLaDA option {key}={cfg[key]!r}; jaxdecode's LLaDA forward "
                              f"implements {key}={want!r} (or the key absent)")
    for key in ("d_model", "n_heads", "n_layers", "vocab_size", "weight_tying"):
        if key not in cfg:
            raise KeyError(key)
    d, n_heads = cfg["d_model"], cfg["n_heads"]
    if d % n_heads:
        raise ConfigError(f"LLaDA d_model ({d}) must be a multiple of n_heads ({n_heads})")
    n_kv = cfg.get("n_kv_heads") or (1 if cfg.get("multi_query_attention") else n_heads)
    vocab = cfg["vocab_size"]
    emb = cfg.get("embedding_size") or vocab
    if emb < vocab:
        raise ConfigError(f"LLaDA embedding_size ({emb}) must be >= vocab_size ({vocab})")
    return dict(  # the qwen2 form: attention_bias means q/k/v biases only, as include_qkv_bias does
        model_type="qwen2", hidden_size=d, num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=d // n_heads, num_hidden_layers=cfg["n_layers"],
        intermediate_size=cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4) * d),
        vocab_size=emb,  # the logits (and wte / ff_out rows) span embedding_size ids
        max_position_embeddings=cfg.get("max_sequence_length", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 10000.0),
        attention_bias=bool(cfg.get("include_qkv_bias", False)), tie_word_embeddings=bool(cfg["weight_tying"]),
        **{k: cfg[k] for k in ("dtype", "torch_dtype", "eos_token_id", "pad_token_id", "bos_token_id") if k in cfg})


def _llada_dict(c: ModelConfig) -> dict:
    """A ModelConfig of model_type 'llada' -> LLaDA's config.json (its other keys from `extra`)."""
    import json
    if c.o_bias or c.mlp_bias or c.rope_scaling is not None or set(c.sliding_windows) != {0}:
        raise ConfigError("a LLaDA config.json cannot express o/MLP biases, rope scaling or sliding windows; "
                          "save this model with model_type 'llama' instead")
    out: dict[str, Any] = {k: json.loads(v) for k, v in c.extra}
    eos = (list(c.eos_token_ids) if len(c.eos_token_ids) > 1
           else (c.eos_token_ids[0] if c.eos_token_ids else None))
    out.update(_LLADA_REQUIRED)
    out.update({k: v for k, v in _LLADA_NEUTRAL.items() if k in out})
    if c.head_dim * c.num_heads != c.hidden_size:
        raise ConfigError(f"LLaDA's head_dim is d_model // n_heads; this config has head_dim={c.head_dim}, "
                          f"hidden_size={c.hidden_size}, num_heads={c.num_heads}")
    out.update(model_type=LLADA_TYPE, architectures=["LLaDAModelLM"], d_model=c.hidden_size,
               n_heads=c.num_heads, n_kv_heads=c.num_kv_heads, n_layers=c.num_layers,
               mlp_hidden_size=c.intermediate_size, max_sequence_length=c.max_position_embeddings,
               embedding_size=c.vocab_size, vocab_size=min(out.get("vocab_size", c.vocab_size), c.vocab_size),
               weight_tying=c.tie_word_embeddings, include_qkv_bias=c.qkv_bias, rms_norm_eps=c.norm_eps,
               rope_theta=c.rope_theta, torch_dtype=c.dtype, eos_token_id=eos, pad_token_id=c.pad_token_id)
    if c.bos_token_id is not None:
        out["bos_token_id"] = c.bos_token_id
    return out


def rope_inv_freqs(config: ModelConfig) -> np.ndarray:
    """Each layer's inverse RoPE frequencies [num_layers, head_dim // 2]: rope_inv_freq's; with a
    local_rope_theta (Gemma 3) the sliding-window layers' own, unscaled; zeros (the identity rotation)
    for a layer without RoPE (SmolLM3)."""
    full = rope_inv_freq(config)
    local = full
    if config.local_rope_theta is not None:
        local = rope_inv_freq(config.replace(rope_theta=config.local_rope_theta, rope_scaling=None))
    rows = [local if w else full for w in config.sliding_windows]
    if config.rope_layers:
        rows = [row if rope else np.zeros_like(row) for row, rope in zip(rows, config.rope_layers)]
    return np.stack(rows)


def rope_attention_factors(config: ModelConfig) -> np.ndarray:
    """Each layer's factor on cos and sin [num_layers]: rope_attention_factor on the layers with the
    scaled RoPE, 1 on Gemma 3's local layers (unscaled) and on layers without RoPE."""
    factor = rope_attention_factor(config)
    local = [config.local_rope_theta is not None and w > 0 for w in config.sliding_windows]
    rope = config.rope_layers or (1,) * config.num_layers
    return np.asarray([factor if r and not lo else 1.0 for r, lo in zip(rope, local)], np.float32)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [rotary_dim // 2], with linear, llama3 or YaRN scaling applied (YaRN's factor
    on cos and sin: rope_attention_factor); LongRoPE's short factors (its long ones: rope_long_inv_freq)."""
    hd = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    sc = config.rope_scaling_dict
    if sc is None:
        return inv.astype(np.float32)
    kind = sc.get("rope_type", "default")
    if kind == "longrope":
        return (inv / np.asarray(sc["short_factor"], np.float64)).astype(np.float32)
    if kind == "linear":
        return (inv / float(sc["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = float(sc["factor"])
        lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    if kind == "yarn":  # YaRN: each frequency between interpolated (/ factor) and kept, by its rotations
        factor = float(sc["factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

        def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in old_ctx
            return hd * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        ramp = np.clip((np.arange(hd // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
        return (inv / factor * (1 - keep) + inv * keep).astype(np.float32)
    raise ConfigError(f"unsupported rope_type {kind!r}")


def rope_long_inv_freq(config: ModelConfig) -> np.ndarray | None:
    """LongRoPE's (Phi-3) inverse frequencies past the pretraining length, by its long factors; None for
    every other RoPE. Which set a forward uses: models.transformer.forward (as transformers: the long one
    once a sequence reaches rope_switch_position)."""
    sc = config.rope_scaling_dict
    if sc is None or sc.get("rope_type") != "longrope":
        return None
    hd = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    return (inv / np.asarray(sc["long_factor"], np.float64)).astype(np.float32)


def rope_switch_position(config) -> int | None:
    """LongRoPE: the first position whose forward takes the long factors (original_max_position_embeddings,
    past which transformers switches); None for every other RoPE (and for configs without one)."""
    sc = getattr(config, "rope_scaling_dict", None)
    if sc is None or sc.get("rope_type") != "longrope":
        return None
    return int(sc["original_max_position_embeddings"])


def rope_long_attention_factor(config: ModelConfig) -> float:
    """The factor on cos and sin with LongRoPE's long factors: Phi-3.5-MoE's long_mscale; rope_attention_factor
    for every other RoPE (Phi-3's factor is the same for both sets)."""
    sc = config.rope_scaling_dict or {}
    if sc.get("rope_type") == "longrope" and sc.get("long_mscale") is not None:
        return float(sc["long_mscale"])
    return rope_attention_factor(config)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor on RoPE's cos and sin (so on q.k twice): YaRN's 0.1 * ln(factor) + 1 (or its
    attention_factor / mscale form); LongRoPE's sqrt(1 + ln(factor) / ln(original length)) (or its
    attention_factor), the same for its short and long factors, or Phi-3.5-MoE's short_mscale (its long_mscale
    with the long factors: rope_long_attention_factor); 1 for every other RoPE."""
    sc = config.rope_scaling_dict
    if sc is None or sc.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    if sc["rope_type"] == "longrope" and sc.get("short_mscale") is not None:
        return float(sc["short_mscale"])
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    if sc["rope_type"] == "longrope":  # factor: the context's growth (transformers' default: the lengths' ratio)
        omax = sc["original_max_position_embeddings"]
        factor = sc.get("factor") or config.max_position_embeddings / omax
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(omax))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(sc["factor"])
    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(factor, float(sc["mscale"])) / mscale(factor, float(sc["mscale_all_dim"]))
    return mscale(factor)
