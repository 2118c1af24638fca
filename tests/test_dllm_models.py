"""Masked-diffusion LM models: the ModelConfig fields, the bidirectional / block-causal masks, and the
LLaDA / Dream / Fast-dLLM v2 checkpoint layouts (tiny random checkpoints written in each layout's own
names, checked against an independent NumPy forward)."""
import json

import numpy as np
import pytest

from models import ConfigError, ModelConfig, bidirectional_mask, block_causal_mask


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
])
def test_config_json_round_trip(kw):
    c = _tiny(**kw)
    text = json.dumps(c.to_hf_dict())  # what save_params writes
    back = ModelConfig.from_hf_dict(json.loads(text))
    assert back == c
    assert back.is_diffusion


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
    from models import padded_causal_mask
    np.testing.assert_array_equal(np.asarray(block_causal_mask(valid, 1)), np.asarray(padded_causal_mask(valid)))
    np.testing.assert_array_equal(np.asarray(block_causal_mask(valid, 7)), bid)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        block_causal_mask(valid, 0)
