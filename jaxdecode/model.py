"""Loading models: `load(path)` -> `Model` (config, parameter pytree, tokenizer), and the embedded
default models shipped inside jaxdecode.models.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import jaxdecode.models as _models_pkg
from jaxdecode.models import ModelConfig, load_params, load_tokenizer

# Shipped with the jaxdecode.models package (models/embedded in the repository).
EMBEDDED_DIR = Path(_models_pkg.__file__).resolve().parent / "embedded"


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, parameter pytree, tokenizer (or None) and where it came from."""
    config: ModelConfig
    params: Any
    tokenizer: Any = None
    path: str | None = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.path} has no tokenizer files; pass prompts as token-id lists")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in tokens)
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)


def embedded_model_path(name: str = "target") -> Path | None:
    """Directory of an embedded default model ("target" or "draft"), or None if not shipped."""
    p = EMBEDDED_DIR / name
    return p if (p / "config.json").exists() else None


def load(path: str | Path | None = None, *, dtype: str | None = None, mesh=None) -> Model:
    """Load a Hugging Face checkpoint directory (config.json + safetensors + tokenizer).

    `path=None` (or "default"/"target"/"draft") loads an embedded default model. `dtype` overrides the
    checkpoint's ("float32", "bfloat16"). With a `mesh`, parameters are sharded over it.
    """
    if path is None or str(path) in ("default", "target", "draft"):
        name = "draft" if str(path) == "draft" else "target"
        found = embedded_model_path(name)
        if found is None:
            raise FileNotFoundError(
                f"the embedded {name} model is not shipped in this checkout ({EMBEDDED_DIR / name}); "
                f"build it with `make models` or pass a checkpoint directory")
        path = found
        dtype = dtype or "float32"  # shipped in bf16 to save space; f32 is faster on CPU
    config, params = load_params(path, dtype=dtype)
    if mesh is not None:
        from jaxdecode.sharding import shard_params
        params = shard_params(params, mesh)
    return Model(config=config, params=params, tokenizer=load_tokenizer(path), path=str(path))
