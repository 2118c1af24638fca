"""Loading models: `load(path)` -> `Model` (config, parameter pytree, tokenizer), and the embedded
default models shipped inside jaxdecode.models.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

import jaxdecode.models as _models_pkg
from jaxdecode.models import ModelConfig, load_params, load_tokenizer

# Shipped with the jaxdecode.models package (models/embedded in the repository).
EMBEDDED_DIR = Path(_models_pkg.__file__).resolve().parent / "embedded"


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, parameter pytree, tokenizer (or None), where it came from, and the
    checkpoint's generation defaults (generation_config.json, or None: jaxdecode.genconfig)."""
    config: ModelConfig
    params: Any
    tokenizer: Any = None
    path: str | None = None
    generation_config: Any = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as transformers encodes it: with the tokenizer's own special tokens (a BOS
        where the tokenizer adds one) unless add_special_tokens=False."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.path} has no tokenizer files; pass prompts as token-id lists")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `tokens`; special tokens (EOS, chat markers) are left out unless skip_special_tokens=False."""
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in tokens)
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)


EMBEDDED_NAMES = ("target", "draft", "dllm")  # the causal target, its draft LM, the diffusion LM


def embedded_model_path(name: str = "target") -> Path | None:
    """Directory of an embedded model (one of EMBEDDED_NAMES), or None if not shipped."""
    if name not in EMBEDDED_NAMES:
        raise ValueError(f"no embedded model named {name!r}; the embedded models are {EMBEDDED_NAMES}")
    p = EMBEDDED_DIR / name
    return p if (p / "config.json").exists() else None


DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: str | None, backend: str | None = None) -> str | None:
    """The one dtype rule of `load` (every checkpoint, the embedded models included).

    dtype=None: float32 on a CPU backend, the checkpoint's own dtype (config.json `dtype` /
    `torch_dtype`) on GPU/TPU. A model computing in bfloat16 runs slower than float32 under XLA:CPU
    (it widens the weights inside each step; weight-only bf16, load(param_dtype=), does not), and
    float32 keeps speculative decoding token-for-token equal to plain greedy decoding
    (README, "Numerics"); accelerators are built for the checkpoint's half precision.
    dtype="auto": the checkpoint's own dtype on every backend. Any name in DTYPES: that dtype.
    Returns the dtype name to load in, or None for "as stored".
    """
    if dtype is None:
        backend = backend or jax.default_backend()
        return "float32" if backend == "cpu" else None
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be None (the default rule), 'auto' (the checkpoint's own) or one of "
                         f"{DTYPES}, got {dtype!r}")
    return dtype


def _param_dtype(name):
    if name not in DTYPES:
        raise ValueError(f"param_dtype must be None (the compute dtype) or one of {DTYPES}, got {name!r}")
    return jnp.dtype(name)


# norm scales and q/k/v biases: never narrowed, whatever their shape (vectors in transformers, Cohere's per-head
# query / key norm scales aside)
_WIDE_PARAMS = ("scale", "bq", "bk", "bv")


def narrow_weights(params, param_dtype: str):
    """Store the weight matrices (every float parameter of 2 or more dims) in `param_dtype`; the 1-D ones
    (norm scales, biases) keep theirs, and with them the dtype the forward computes in
    (models.transformer.forward). What `load(param_dtype=...)` does after loading."""
    dt = _param_dtype(param_dtype)

    def narrow(path, a, stacked: bool):  # stacked: the layer weights carry a leading layer axis
        # norm scales and biases stay wide whatever their shape (OLMo 2's and Cohere's query norms and Qwen2's
        # query bias are [heads, head_dim] per layer)
        name = getattr(path[-1], "key", None) if path else None
        is_matrix = a.ndim - int(stacked) >= 2 and name not in _WIDE_PARAMS
        return a.astype(dt) if is_matrix and jnp.issubdtype(a.dtype, jnp.floating) else a

    layers = params.get("layers")
    stacked = layers is not None and not isinstance(layers, (tuple, list))
    out = {k: jax.tree_util.tree_map_with_path(lambda p, a: narrow(p, a, False), v)
           for k, v in params.items() if k != "layers"}
    if layers is not None:
        out["layers"] = jax.tree_util.tree_map_with_path(lambda p, a: narrow(p, a, stacked), layers)
    return out


def model_path(path: str | Path | None = None) -> str | Path:
    """The directory `load(path)` reads: an embedded model for None, "default" or a name of EMBEDDED_NAMES,
    unless a directory of that name exists in the working directory (a user who trained into `--out
    draft` and loads "draft" means that directory); else `path` itself (not checked here)."""
    if path is None or (str(path) in ("default",) + EMBEDDED_NAMES and not Path(path).is_dir()):
        name = str(path) if str(path) in EMBEDDED_NAMES else "target"
        found = embedded_model_path(name)
        if found is None:
            raise FileNotFoundError(
                f"the embedded {name} model is not shipped in this checkout ({EMBEDDED_DIR / name}); "
                f"build it with `make models` or pass a checkpoint directory")
        return found
    return path


def load(path: str | Path | None = None, *, dtype: str | None = None, param_dtype: str | None = None,
         mesh=None) -> Model:
    """Load a Hugging Face checkpoint directory (config.json + safetensors + tokenizer).

    `path=None` (or "default", or a name of EMBEDDED_NAMES: "target", "draft", "dllm") loads an embedded
    model, unless a directory of that name exists in the working directory (it wins); "dllm" is the
    diffusion LM adapted from the target (method="diffusion"). `dtype`: None = the default rule
    (`resolve_dtype`: float32 on CPU, the checkpoint's dtype on GPU/TPU), "auto" = the checkpoint's
    dtype, or "float32" / "bfloat16" / "float16". `param_dtype`: None = `dtype`, or a dtype to store the
    weight matrices in while the forward computes in `dtype` (weight-only half precision, e.g.
    `dtype="float32", param_dtype="bfloat16"`: the activations, KV cache and logits stay float32 and
    each matmul runs bf16 x bf16 -> f32; README "Numerics and dtypes"). With a `mesh`,
    parameters are sharded over it.
    """
    path = model_path(path)
    if param_dtype is not None:
        _param_dtype(param_dtype)  # a bad name fails before the checkpoint is read
    config, params = load_params(path, dtype=resolve_dtype(dtype))
    if param_dtype is not None:
        params = narrow_weights(params, param_dtype)
    if mesh is not None:
        from jaxdecode.sharding import check_mesh, shard_params
        check_mesh(mesh)
        params = shard_params(params, mesh)  # jax.make_mesh's Explicit axes are used as Auto ones there
    from jaxdecode.genconfig import GenerationConfig
    return Model(config=config, params=params, tokenizer=load_tokenizer(path), path=str(path),
                 generation_config=GenerationConfig.from_pretrained(path))
