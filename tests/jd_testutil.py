"""Helpers for tests: tiny random Hugging Face checkpoints with a real tokenizer, built offline."""
from __future__ import annotations

from pathlib import Path

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nimport os\nimport sys\nprint('hello world')\n"
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n"
) * 4


def make_tokenizer(out_dir, vocab_size: int = 320):
    """Train a byte-level BPE on a fixed snippet; saved so AutoTokenizer loads it offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out_dir))
    return fast


def make_hf_model(kind: str, vocab_size: int = 320, seed: int = 0, random_norms: bool = False,
                  random_biases: bool = False, **overrides):
    """A random transformers model of the given family, in eval mode (no dropout). random_norms: the norms'
    scales drawn around 1 instead of all ones (a norm applied in the wrong place then shows); Gemma's norms
    scale by 1 + weight, so their weights are drawn around 0. random_biases: the linear layers' biases
    drawn instead of transformers' zeros (every weight named *norm*: Cohere's LayerNorms and per-head query /
    key norm scales too)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    base = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **base)
        cls = tf.GPT2LMHeadModel
    else:
        llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        cfg_cls, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
                        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
                        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
                        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
                        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
                        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
                        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
                        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
                        "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
                        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
                        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
                        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
                        "cohere": (tf.CohereConfig, tf.CohereForCausalLM),
                        "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM),
                        "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM),
                        "granitemoeshared": (tf.GraniteMoeSharedConfig, tf.GraniteMoeSharedForCausalLM),
                        "phimoe": (tf.PhimoeConfig, tf.PhimoeForCausalLM)}[kind]
        if kind.startswith("gemma"):  # their configs derive layer types and RoPE sets at init
            llama_like.update(head_dim=8, **overrides)
            overrides = {}
        # so do these (Phi-3: the partial rotary factor, longrope; Command R7B: its layer types)
        if kind in ("phi3", "olmo2", "olmo3", "granite", "cohere", "cohere2"):
            llama_like.update(**overrides)
            overrides = {}
        if kind in ("mixtral", "qwen3_moe", "granitemoe", "granitemoeshared", "phimoe"):  # 4 experts, 2 per token;
            # Qwen3-MoE's narrower than the MLP; Granite-MoE-shared's shared MLP 40 wide
            if kind == "granitemoeshared":
                llama_like.update(shared_intermediate_size=40)
            llama_like.update(num_local_experts=4, num_experts_per_tok=2, **overrides)
            if kind == "qwen3_moe":
                llama_like.update(moe_intermediate_size=24, head_dim=8)
            overrides = {}
        if kind in ("qwen2_moe", "olmoe"):  # 4 experts, 2 per token (Qwen2-MoE: 24 wide, its shared expert 40)
            moe = dict(num_experts=4, num_experts_per_tok=2)
            if kind == "qwen2_moe":
                moe.update(moe_intermediate_size=24, shared_expert_intermediate_size=40)
            llama_like.update(**moe, **overrides)
            overrides = {}
        cfg = cfg_cls(**{**llama_like, **base})
    for k, v in overrides.items():
        setattr(cfg, k, v)
    # Larger init than the default spreads the logits, so greedy choices are not near-ties.
    cfg.initializer_range = overrides.get("initializer_range", 0.2)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if random_norms and "norm" in name:  # a LayerNorm's bias (Phi-3.5-MoE) around 0, as Gemma's weights
                zero = kind.startswith("gemma") or name.endswith(".bias")
                w.copy_((0 if zero else 1) + 0.5 * torch.randn_like(w))
            elif random_biases and name.endswith(".bias") and "norm" not in name:
                w.copy_(0.5 * torch.randn_like(w))
    return model


def phimoe_rope_by_length(model):
    """transformers' Phi-3.5-MoE (PhimoeForCausalLM) with its LongRoPE factors chosen by each forward's sequence
    length, as Microsoft's reference and earlier transformers choose them: 5.25 calls the LongRoPE init without the
    length, so past original_max_position_embeddings it keeps the short factors (with long_mscale). Returns model."""
    emb = model.model.rotary_emb
    init = emb.rope_init_fn

    def forward(x, position_ids=None, **kw):
        emb.rope_init_fn = lambda config, *a, **k: init(config, x.device, int(position_ids.max()) + 1)
        try:
            return type(emb).forward(emb, x, position_ids, **kw)
        finally:
            emb.rope_init_fn = init
    emb.forward = forward
    return model


def phimoe_like(config, seed: int = 0, std: float = 0.3):
    """(config, params) of a tiny Phi-3.5-MoE target of config's shape (LayerNorms, attention biases, sparsemixer
    over 4 experts) whose LM-head bias is drawn at random: init_params' zeros would hide a drafter that drops it."""
    import jax

    from jaxdecode.models import init_params
    cfg = config.replace(model_type="phimoe", layer_norm=True, lm_head_bias=True, qkv_bias=True, o_bias=True,
                         sparsemixer_eps=0.3, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=config.intermediate_size, moe_norm_topk=False)
    params = init_params(cfg, jax.random.PRNGKey(seed), std=std)
    bias = jax.random.normal(jax.random.PRNGKey(seed + 1), (cfg.vocab_size,), params["embed"].dtype)
    return cfg, {**params, "lm_head_bias": bias}


def make_checkpoint(kind: str, out_dir, vocab_size: int = 320, seed: int = 0, **overrides) -> Path:
    out_dir = Path(out_dir)
    make_hf_model(kind, vocab_size, seed, **overrides).save_pretrained(str(out_dir))
    make_tokenizer(out_dir, vocab_size)
    return out_dir


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_bos_tokenizer(out_dir, vocab_size: int = 320, chat_template: str | None = CHATML):
    """A Llama-style tokenizer: byte-level BPE whose encoding starts with a BOS `<s>` (a post-processor, as
    Llama / Mistral tokenizers do), EOS `</s>`, ChatML markers as special tokens and, by default, a ChatML
    chat template. Special ids: <s> 0, </s> 1, <|im_start|> 2, <|im_end|> 3."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


class PieceTokenizer:
    """A tokenizer over a fixed list of string pieces (id = index; the constraint compilers read
    get_vocab): characters plus a few merges, so a token may span several characters."""

    def __init__(self, pieces, eos_id: int, mask_id: int):
        self.pieces, self.eos_token_id, self.all_special_ids = list(pieces), eos_id, [eos_id, mask_id]

    def get_vocab(self):
        return {p: i for i, p in enumerate(self.pieces)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids))


def dllm_config(vocab_size: int, mask_id: int, **kw):
    """A one-layer masked-diffusion ModelConfig (bidirectional unless kw says otherwise)."""
    from jaxdecode.models import ModelConfig

    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=96, mask_token_id=mask_id,
                       **{"attention": "bidirectional", **kw})


def tiny_dllm(vocab_size: int, mask_id: int, batch: int = 6, **kw):
    """(config, params, prompts int32[batch, 4], prompt lengths) of a one-layer bidirectional masked-diffusion
    model with random weights, for decoder tests."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxdecode.models import init_params

    cfg = dllm_config(vocab_size, mask_id, **kw)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    prompts = jnp.asarray(np.random.RandomState(0).randint(1, 20, (batch, 4)), jnp.int32)
    lens = jnp.asarray([4, 3, 4, 2, 4, 1][:batch], jnp.int32)
    return cfg, params, prompts, lens


# Arithmetic expressions in Lark: the grammar tests' common example (recursive: parentheses nest).
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+/
"""
