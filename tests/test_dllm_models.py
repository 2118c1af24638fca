"""Masked-diffusion LM models: the ModelConfig fields, the bidirectional / block-causal masks, and the
LLaDA / Dream / Fast-dLLM v2 checkpoint layouts (tiny random checkpoints written in each layout's own
names, checked against an independent NumPy forward)."""
import json

import numpy as np
import pytest

from jaxdecode.models import ConfigError, ModelConfig, bidirectional_mask, block_causal_mask


def _tiny(**kw) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=24, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=64)
    base.update(kw)
    return ModelConfig(**base)


# ----------------------------------------------------------------------------- config fields
def test_config_defaults_are_causal():
    c = _tiny()
    assert (c.attention, c.block_size, c.logits_shift, c.mask_token_id) == ("causal", 0, 0, None)
    assert not c.is_diffusion
    assert "diffusion_attention" not in c.to_hf_dict() and "mask_token_id" not in c.to_hf_dict()


@pytest.mark.parametrize("kw, match", [
    (dict(attention="block"), "needs block_size > 0"),
    (dict(attention="block", block_size=-2), "needs block_size > 0"),
    (dict(block_size=4), "only meaningful with attention='block'"),
    (dict(attention="bidir"), "is not one of"),
    (dict(mask_token_id=24), r"not a token id .*0 \.\. 23"),
    (dict(mask_token_id=-1), "not a token id"),
    (dict(logits_shift=1), "logits_shift=1 is for diffusion LMs"),
    (dict(attention="bidirectional", logits_shift=2), "logits_shift must be 0 or 1"),
])
def test_config_bad_diffusion_fields(kw, match):
    with pytest.raises(ConfigError, match=match):
        _tiny(**kw)


@pytest.mark.parametrize("kw", [
    dict(attention="bidirectional", mask_token_id=23),
    dict(attention="block", block_size=4, mask_token_id=0, logits_shift=1),
    dict(model_type="qwen2", qkv_bias=True, attention="bidirectional", mask_token_id=5, logits_shift=1),
    dict(model_type="llada", attention="bidirectional", mask_token_id=23),
    dict(model_type="Dream", qkv_bias=True, attention="bidirectional", mask_token_id=23, logits_shift=1),
    dict(model_type="Fast_dLLM_Qwen", qkv_bias=True, attention="block", block_size=8, mask_token_id=2,
         logits_shift=1),
    dict(model_type="Dream", qkv_bias=True, attention="bidirectional", mask_token_id=3),  # no shift: said
    dict(model_type="gpt2", num_kv_heads=4, head_dim=4, qkv_bias=True, o_bias=True, mlp_bias=True,
         tie_word_embeddings=True, activation="gelu_new", attention="bidirectional", mask_token_id=1),
])
def test_config_json_round_trip(kw):
    c = _tiny(**kw)
    text = json.dumps(c.to_hf_dict())  # what save_params writes
    back = ModelConfig.from_hf_dict(json.loads(text))
    assert back == c
    assert back.is_diffusion


def test_qwen2_without_qkv_bias_round_trips():  # Qwen2's default is biases on: saying none is kept
    c = _tiny(model_type="qwen2", qkv_bias=False)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


def test_llada_config_defaults():
    cfg = _config_json("llada", n_kv_heads=None, mlp_hidden_size=None, embedding_size=None, mask_token_id=5)
    c = ModelConfig.from_hf_dict(cfg)
    assert (c.num_kv_heads, c.intermediate_size, c.vocab_size, c.head_dim) == (H, 4 * D, TOK_VOCAB, D // H)
    assert c.is_diffusion and c.attention == "bidirectional" and c.logits_shift == 0
    out = c.to_hf_dict()
    assert out["auto_map"] == cfg["auto_map"] and out["rope"] is True and out["n_kv_heads"] == H


# ----------------------------------------------------------------------------- masks
def _np_block_mask(valid, bs, offset):
    b, t = valid.shape
    out = np.zeros((b, t, t), bool)
    for r in range(b):
        off = offset[r] if np.ndim(offset) else offset
        for i in range(t):
            for j in range(t):
                out[r, i, j] = valid[r, j] and (off + j) // bs <= (off + i) // bs
    return out


def test_masks():
    rng = np.random.default_rng(0)
    valid = rng.random((3, 7)) < 0.8
    bid = np.asarray(bidirectional_mask(valid))
    assert bid.shape == (3, 7, 7) and (bid == valid[:, None, :]).all()
    for bs, off in [(1, 0), (2, 0), (3, 5), (4, np.array([0, 1, 6]))]:
        got = np.asarray(block_causal_mask(valid, bs, off))
        np.testing.assert_array_equal(got, _np_block_mask(valid, bs, off))
    # block_size 1 is the padded causal mask; a block covering everything is the bidirectional one
    from jaxdecode.models import padded_causal_mask
    np.testing.assert_array_equal(np.asarray(block_causal_mask(valid, 1)), np.asarray(padded_causal_mask(valid)))
    np.testing.assert_array_equal(np.asarray(block_causal_mask(valid, 7)), bid)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        block_causal_mask(valid, 0)


# ----------------------------------------------------------------------------- checkpoint layouts
# Tiny shapes: D hidden, H / KV heads of HD dims, F MLP width, V ids (LLaDA pads its embedding to a
# multiple of 128 above the tokenizer's vocab_size, as the 8B model does), L layers.
D, H, KV, HD, F, V, L = 16, 4, 2, 4, 24, 384, 2
TOK_VOCAB = 320  # the test tokenizer's size (+ its MASK token: id 320)
THETA, EPS = 500000.0, 1e-5


def _llada_names(i):
    p = f"model.transformer.blocks.{i}."
    return dict(n1=p + "attn_norm.weight", n2=p + "ff_norm.weight", q=p + "q_proj", k=p + "k_proj",
                v=p + "v_proj", o=p + "attn_out", gate=p + "ff_proj", up=p + "up_proj", down=p + "ff_out")


def _qwen2_names(i):
    p = f"model.layers.{i}."
    return dict(n1=p + "input_layernorm.weight", n2=p + "post_attention_layernorm.weight",
                q=p + "self_attn.q_proj", k=p + "self_attn.k_proj", v=p + "self_attn.v_proj",
                o=p + "self_attn.o_proj", gate=p + "mlp.gate_proj", up=p + "mlp.up_proj", down=p + "mlp.down_proj")


_GLOBALS = {"llada": dict(emb="model.transformer.wte.weight", norm="model.transformer.ln_f.weight",
                          head="model.transformer.ff_out.weight"),
            "qwen2": dict(emb="model.embed_tokens.weight", norm="model.norm.weight", head="lm_head.weight")}
_NAMES = {"llada": _llada_names, "qwen2": _qwen2_names}


def _config_json(layout: str, **over) -> dict:
    """config.json of each layout, in its own keys (written by hand, not by to_hf_dict)."""
    if layout == "llada":  # the keys of GSAI-ML/LLaDA-8B-Base's config.json that matter, tiny
        cfg = dict(model_type="llada", architectures=["LLaDAModelLM"], d_model=D, n_heads=H, n_kv_heads=KV,
                   n_layers=L, mlp_hidden_size=F, mlp_ratio=4, vocab_size=TOK_VOCAB, embedding_size=V,
                   weight_tying=False, mask_token_id=V - 48, rope=True, rope_theta=THETA, rms_norm_eps=EPS,
                   block_type="llama", activation_type="silu", layer_norm_type="rms", include_bias=False,
                   include_qkv_bias=False, alibi=False, input_emb_norm=False, scale_logits=False,
                   attention_layer_norm=False, block_group_size=1, layer_norm_with_affine=True,
                   max_sequence_length=64, eos_token_id=0, pad_token_id=0, torch_dtype="float32",
                   flash_attention=False, auto_map={"AutoModel": "modeling_llada.LLaDAModelLM"})
    else:  # Dream-org/Dream-v0-Base-7B / Efficient-Large-Model/Fast_dLLM_v2_7B: Qwen2 keys + theirs
        cfg = dict(model_type=layout, hidden_size=D, num_attention_heads=H, num_key_value_heads=KV,
                   num_hidden_layers=L, intermediate_size=F, vocab_size=V, max_position_embeddings=64,
                   rope_theta=THETA, rms_norm_eps=EPS, hidden_act="silu", tie_word_embeddings=False,
                   use_sliding_window=False, sliding_window=None, bos_token_id=0, eos_token_id=0,
                   pad_token_id=0, torch_dtype="float32")
        if layout == "Dream":
            cfg.update(architectures=["DreamModel"], mask_token_id=V - 1,
                       auto_map={"AutoModel": "modeling_dream.DreamModel"})
        else:  # Fast-dLLM v2 keeps its MASK in the tokenizer only
            cfg.update(architectures=["Fast_dLLM_QwenForCausalLM"], bd_size=4)
    cfg.update(over)
    return cfg


def _random_tensors(layout: str, rng, bias: bool, tied: bool, kv: int) -> dict:
    form = "llada" if layout == "llada" else "qwen2"
    names, glob = _NAMES[form], _GLOBALS[form]
    t = {}
    for i in range(L):
        n = names(i)
        t[n["n1"]], t[n["n2"]] = 1 + 0.2 * rng.standard_normal(D), 1 + 0.2 * rng.standard_normal(D)
        for key, out in (("q", H * HD), ("k", kv * HD), ("v", kv * HD)):
            t[n[key] + ".weight"] = 0.4 * rng.standard_normal((out, D))
            if bias:
                t[n[key] + ".bias"] = 0.3 * rng.standard_normal(out)
        t[n["o"] + ".weight"] = 0.3 * rng.standard_normal((D, H * HD))
        t[n["gate"] + ".weight"] = 0.3 * rng.standard_normal((F, D))
        t[n["up"] + ".weight"] = 0.3 * rng.standard_normal((F, D))
        t[n["down"] + ".weight"] = 0.3 * rng.standard_normal((D, F))
    t[glob["emb"]] = rng.standard_normal((V, D))
    t[glob["norm"]] = 1 + 0.2 * rng.standard_normal(D)
    if not tied:
        t[glob["head"]] = 0.3 * rng.standard_normal((V, D))
    return {k: np.asarray(v, np.float32) for k, v in t.items()}


def _tokenizer(out_dir):
    from jd_testutil import make_tokenizer
    tok = make_tokenizer(out_dir, TOK_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": ["|<MASK>|"]})  # Fast-dLLM v2's MASK
    tok.save_pretrained(str(out_dir))
    return tok


def _write(out_dir, layout: str, seed: int = 0, tokenizer: bool = False, **over):
    from safetensors.numpy import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = _config_json(layout, **over)
    bias = cfg.get("include_qkv_bias", layout != "llada")  # Qwen2's q/k/v biases
    tensors = _random_tensors(layout, np.random.default_rng(seed), bias,
                              cfg.get("weight_tying", cfg.get("tie_word_embeddings")),
                              cfg.get("n_kv_heads", cfg.get("num_key_value_heads")))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg))
    if tokenizer:
        _tokenizer(out_dir)
    return tensors


def _np_forward(layout: str, t: dict, tokens, mask):
    """Independent float64 forward from the checkpoint's own tensors: logits [B, T, V].
    mask[b, i, j]: token i sees token j (every row must see at least one token)."""
    form = "llada" if layout == "llada" else "qwen2"
    names, glob = _NAMES[form], _GLOBALS[form]
    t = {k: v.astype(np.float64) for k, v in t.items()}
    b, n_tok = tokens.shape
    inv = 1.0 / THETA ** (np.arange(0, HD, 2) / HD)
    ang = np.arange(n_tok)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(z):  # [B, T, N, HD], rotate-half
        rot = np.concatenate([-z[..., HD // 2:], z[..., :HD // 2]], -1)
        return z * cos[None, :, None] + rot * sin[None, :, None]

    def rms(z, w):
        return z / np.sqrt((z * z).mean(-1, keepdims=True) + EPS) * w

    x = t[glob["emb"]][tokens]
    for i in range(L):
        n = names(i)
        h = rms(x, t[n["n1"]])

        def proj(key, heads):
            y = h @ t[n[key] + ".weight"].T + t.get(n[key] + ".bias", 0.0)
            return y.reshape(b, n_tok, heads, HD)
        kv = t[n["k"] + ".weight"].shape[0] // HD
        q, k, v = rope(proj("q", H)), rope(proj("k", kv)), proj("v", kv)
        k, v = np.repeat(k, H // kv, axis=2), np.repeat(v, H // kv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
        s = np.where(mask[:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, n_tok, H * HD) @ t[n["o"] + ".weight"].T
        h = rms(x, t[n["n2"]])
        g = h @ t[n["gate"] + ".weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ t[n["up"] + ".weight"].T)) @ t[n["down"] + ".weight"].T
    return rms(x, t[glob["norm"]]) @ t.get(glob["head"], t[glob["emb"]]).T


def _our_forward(config, params, tokens, mask):
    import jax.numpy as jnp
    from jaxdecode.models import forward
    b, n_tok = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(n_tok, dtype=jnp.int32), (b, n_tok))
    logits, _, _ = forward(config, params, jnp.asarray(tokens), pos, None, jnp.asarray(mask))
    return np.asarray(logits)


LAYOUTS = ("llada", "Dream", "Fast_dLLM_Qwen")


@pytest.mark.parametrize("layout, over", [(x, {}) for x in LAYOUTS] + [
    ("llada", dict(include_qkv_bias=True, weight_tying=True, n_kv_heads=H)),
    ("Dream", dict(tie_word_embeddings=True, num_key_value_heads=1))])
def test_layout_loads_and_matches_numpy_forward(tmp_path, layout, over):
    from jaxdecode.models import load_params
    tensors = _write(tmp_path, layout, tokenizer=layout == "Fast_dLLM_Qwen", **over)
    config, params = load_params(tmp_path)
    assert config.model_type == layout and config.is_diffusion and config.vocab_size == V
    want = {"llada": ("bidirectional", 0, 0, V - 48), "Dream": ("bidirectional", 0, 1, V - 1),
            "Fast_dLLM_Qwen": ("block", 4, 1, TOK_VOCAB)}[layout]  # Fast-dLLM: the tokenizer's |<MASK>|
    assert (config.attention, config.block_size, config.logits_shift, config.mask_token_id) == want
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (2, 10))
    valid = np.ones((2, 10), bool)
    valid[1, 7:] = False  # a padded row
    for mask in (np.asarray(bidirectional_mask(valid)), np.asarray(block_causal_mask(valid, 4)),
                 np.asarray(block_causal_mask(valid, 3, np.array([0, 2])))):
        np.testing.assert_allclose(_our_forward(config, params, tokens, mask),
                                   _np_forward(layout, tensors, tokens, mask), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_save_load_round_trip(tmp_path, layout):
    import jax
    from safetensors.numpy import load_file
    from jaxdecode.models import load_params, save_params
    tensors = _write(tmp_path / "a", layout, tokenizer=layout == "Fast_dLLM_Qwen")
    config, params = load_params(tmp_path / "a")
    save_params(config, params, tmp_path / "b")
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert sorted(saved) == sorted(tensors)  # the layout's own names, nothing more or less
    for k in tensors:
        np.testing.assert_array_equal(saved[k], tensors[k])
    written = json.loads((tmp_path / "b" / "config.json").read_text())
    original = _config_json(layout)
    for key in ("model_type", "architectures", "mask_token_id", "bd_size", "d_model", "n_kv_heads",
                "embedding_size", "vocab_size", "auto_map", "flash_attention", "hidden_size"):
        if key in original:
            assert written[key] == original[key], key
    config2, params2 = load_params(tmp_path / "b")
    assert config2 == config
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, params2))


def test_block_cache_reuse_equals_recomputation():
    """Block diffusion: a finished block's KV cache, written and advanced, serves the next block
    exactly as recomputing both under the block-causal mask (rows at different lengths)."""
    import jax
    import jax.numpy as jnp
    from jaxdecode.models import advance, forward, init_cache, param_shapes
    bs = 4
    config = _tiny(model_type="qwen2", qkv_bias=True, attention="block", block_size=bs, mask_token_id=0,
                   logits_shift=1)
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda shape: jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    seqs = rng.integers(1, config.vocab_size, (2, 12))
    done = np.array([8, 4])  # committed tokens per row: whole blocks
    full_valid = np.arange(12)[None, :] < (done + bs)[:, None]
    full = _our_forward(config, params, seqs, np.asarray(block_causal_mask(full_valid, bs)))

    cache = init_cache(config, 2, 16)
    first = jnp.asarray(seqs[:, :8])
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    first_valid = jnp.arange(8)[None, :] < jnp.asarray(done)[:, None]
    _, _, cache = forward(config, params, first, pos, cache, block_causal_mask(first_valid, bs))
    assert np.asarray(cache.lengths).tolist() == [0, 0]  # nothing committed by the forward
    cache = advance(cache, jnp.asarray(done))
    nxt = np.stack([seqs[r, done[r]:done[r] + bs] for r in range(2)])
    pos = jnp.asarray(done[:, None] + np.arange(bs)[None, :], jnp.int32)
    mask = block_causal_mask(jnp.ones((2, bs), bool), bs, jnp.asarray(done))  # one whole block: all-ones
    assert bool(mask.all())
    logits, _, _ = forward(config, params, jnp.asarray(nxt), pos, cache, mask)
    for r in range(2):
        np.testing.assert_allclose(np.asarray(logits[r]), full[r, done[r]:done[r] + bs], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout, over, err, match", [
    ("Fast_dLLM_Qwen", dict(bd_size=None), "ConfigError", "needs block_size > 0"),
    ("Dream", dict(mask_token_id=V), "ConfigError", r"mask_token_id=384 is not a token id"),
    ("llada", dict(mask_token_id=-3), "ConfigError", "not a token id"),
    ("llada", dict(activation_type="swiglu"), "ConfigError", "unsupported LLaDA option activation_type"),
    ("llada", dict(rope=None), "ConfigError", "unsupported LLaDA option rope"),
    ("llada", dict(scale_logits=True), "ConfigError", "unsupported LLaDA option scale_logits"),
    ("llada", dict(embedding_size=256), "ConfigError", "embedding_size .* must be >= vocab_size"),
    ("Dream", dict(diffusion_attention="sideways"), "ConfigError", "is not one of"),
])
def test_bad_checkpoints_error_clearly(tmp_path, layout, over, err, match):
    import jaxdecode.models as models
    _write(tmp_path, layout, **over)
    with pytest.raises(getattr(models, err), match=match):
        models.load_params(tmp_path)


def test_llada_missing_tensor_named_in_its_layout(tmp_path):
    from safetensors.numpy import save_file
    from jaxdecode.models import CheckpointError as CE, load_params
    tensors = _write(tmp_path, "llada")
    del tensors["model.transformer.blocks.1.ff_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CE, match="missing weight tensor 'model.transformer.blocks.1.ff_proj.weight'"):
        load_params(tmp_path)


def test_tied_config_with_a_different_stored_head_errors(tmp_path):
    from safetensors.numpy import save_file
    from jaxdecode.models import CheckpointError as CE, load_params
    tensors = _write(tmp_path, "llada", weight_tying=True)
    tensors["model.transformer.ff_out.weight"] = tensors["model.transformer.wte.weight"].copy()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load_params(tmp_path)  # a stored copy of the embedding is fine
    tensors["model.transformer.ff_out.weight"][0, 0] += 1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CE, match="'model.transformer.ff_out.weight' is stored but differs from the embedding"):
        load_params(tmp_path)


def test_llada_missing_key_names_it(tmp_path):
    from jaxdecode.models import ConfigError as CE, load_params
    _write(tmp_path, "llada")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["d_model"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CE, match="has no 'd_model', which a llada config needs"):
        load_params(tmp_path)


def test_jaxdecode_load_llada(tmp_path):
    import jaxdecode
    _write(tmp_path, "llada", tokenizer=True)
    model = jaxdecode.load(tmp_path)
    assert model.config.is_diffusion and model.config.mask_token_id == V - 48
    assert model.tokenizer is not None and model.encode("def add(a, b):")
