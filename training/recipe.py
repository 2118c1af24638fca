"""The recipe of the embedded default models: one home for the constants that building them
(`build_embedded`) and reporting on them (`report`) both read.
"""
from __future__ import annotations

from .trainer import TrainConfig

VOCAB_SIZE = 4096
HELD_OUT_FRACTION = 0.05
SEQ_LEN = 256
MAX_POSITIONS = 512
EXPORT_DTYPE = "bfloat16"

# (model size, TrainConfig, LMTrainSpec kwargs) of the shipped models.
RECIPES = {
    "target": ("small", TrainConfig(steps=400, learning_rate=2e-3, warmup_steps=30, seed=0,
                                    log_every=10, eval_every=50, checkpoint_every=50,
                                    keep_checkpoints=3, data_parallel=1),
               dict(batch_size=8, seq_len=SEQ_LEN, eval_batch_size=8, eval_max_batches=4)),
    "draft": ("draft", TrainConfig(steps=600, learning_rate=3e-3, warmup_steps=30, seed=1,
                                   log_every=10, eval_every=100, checkpoint_every=100,
                                   keep_checkpoints=3, data_parallel=1),
              dict(batch_size=8, seq_len=SEQ_LEN, eval_batch_size=8, eval_max_batches=4)),
}
# The shipped draft, distilled on-policy from the shipped target (build_embedded stage `distill-draft`:
# `jaxdecode train draft-lm --data self`, the "draft" size): trained from scratch on the target's own
# continuations of `prompts` training-split prompts. A first try on 1024 prompts (800 steps, batch 8) reached
# held-out tau 2.40 at a held-out loss of 5.43 against a training loss of 2.26: too few distinct texts.
# The retrieval drafter's datastore: the shipped target's greedy continuations of 16384 stdlib training-split
# prompts (32 + 96 tokens), kept from 8 tokens before each continuation (3.4 MB of uint16 rows).
RETRIEVAL = dict(prompts=16384, prompt_len=32, seq_len=128, greedy_fraction=1.0, seed=0)
DISTILLED_DRAFT = dict(steps=3000, batch_size=16, learning_rate=3e-3, warmup_steps=50, seed=0, prompts=8192,
                       prompt_len=32, seq_len=96, temperature=0.7, greedy_fraction=0.5, eval_every=500)
# Continued training, one entry per further phase: a fresh AdamW with a new warmup + cosine and a new
# data seed, starting from the previous phase's final params (workdir <model>-2, <model>-3, ...).
# A finished cosine cannot be extended, and on a shared CPU the time a run gets is not known in advance.
CONTINUATIONS = {
    "target": [TrainConfig(steps=500, learning_rate=1.5e-3, warmup_steps=20, seed=2, log_every=10,
                           eval_every=50, checkpoint_every=50, keep_checkpoints=3, data_parallel=1),
               TrainConfig(steps=1700, learning_rate=1e-3, warmup_steps=50, seed=3, log_every=10,
                           eval_every=100, checkpoint_every=100, keep_checkpoints=3, data_parallel=1)],
}

# Phases that train on the stdlib plus a slice of installed packages (corpus `corpus-packages`) instead
# of the stdlib alone: a model that has only seen the stdlib compresses other Python badly (2.67
# bits/byte outside the corpus after phase 2, against 1.82 on the held-out stdlib).
PACKAGE_PHASES = ("target-3",)
# Import names, each given about PACKAGE_SAMPLE_BYTES of its sources (`corpus.sample_package_sources`: the
# file that crosses the budget is kept).
# Never the packages of the outside-corpus compression sample (compression.OUTSIDE_PACKAGES).
PACKAGES = ("jax", "numpy", "transformers", "torch", "scipy", "sympy", "networkx", "matplotlib", "pip",
            "setuptools", "pygments", "huggingface_hub", "orbax", "IPython", "tornado", "pydantic", "_pytest",
            "rich", "prompt_toolkit", "PIL", "jedi", "fsspec", "click", "jinja2")
PACKAGE_SAMPLE_BYTES = 1_300_000
PACKAGE_FILE_MAX_BYTES = 200_000


def phase_corpus(dirname: str) -> str:
    """The corpus directory (under the work directory) a training phase reads."""
    return "corpus-packages" if dirname in PACKAGE_PHASES else "corpus"


def phases(name: str) -> list[tuple[str, TrainConfig]]:
    """(workdir name, TrainConfig) of each training phase of a model, in order."""
    first = RECIPES[name][1]
    return [(name, first)] + [(f"{name}-{i + 2}", c) for i, c in enumerate(CONTINUATIONS.get(name, []))]


def recipe(name: str, vocab_size: int, eos: int):
    """(ModelConfig, TrainConfig, LMTrainSpec) of one shipped model for a tokenizer."""
    from .lm import LMTrainSpec, model_config
    size, tcfg, spec = RECIPES[name]
    return model_config(size, vocab_size, MAX_POSITIONS, eos), tcfg, LMTrainSpec(**spec)
