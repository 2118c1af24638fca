"""jaxdecode.models: the networks as pure functions over parameter pytrees, and HF load/save."""
from .cache import KVCache, advance, commit, init_cache, reorder_rows
from .config import ConfigError, ModelConfig, rope_inv_freq
from .hf import CheckpointError, load_params, load_tokenizer, save_params, to_hf_tensors
from .transformer import (bidirectional_mask, block_causal_mask, causal_mask, forward, init_params,
                          padded_causal_mask, param_shapes, split_layers, with_embed_words)

__all__ = [
    "KVCache", "advance", "commit", "init_cache", "reorder_rows", "ConfigError", "ModelConfig",
    "rope_inv_freq", "CheckpointError", "load_params", "load_tokenizer", "save_params",
    "to_hf_tensors", "bidirectional_mask", "block_causal_mask", "causal_mask", "forward", "init_params",
    "padded_causal_mask", "param_shapes", "split_layers", "with_embed_words",
]
