"""Tiny, fast fixtures for tests, built by the same code as the real models (seconds on a CPU).

    src = write_tiny_sources(tmp / "src")              # a dozen small Python files
    tok, corpus = build_tiny_corpus(src, tmp)          # 320-token BPE + memmap corpus
    model_dir = build_tiny_lm(tmp / "lm")              # all of it, plus a trained tiny LM (HF dir)
"""
from __future__ import annotations

from pathlib import Path

_SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nprint('hello world')\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "with open(path) as f:\n    for line in f:\n        print(line.strip())\n",
]


def write_tiny_sources(out_dir, num_files: int = 16) -> Path:
    """Deterministic small Python files (different mixes of the snippets, so they differ)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        parts = [_SNIPPETS[(i * 7 + j * 3) % len(_SNIPPETS)] for j in range(6 + i % 5)]
        (out_dir / f"mod_{i:02d}.py").write_text(f"# module {i}\n" + "\n".join(parts))
    return out_dir


def build_tiny_corpus(src_dir, out_dir, vocab_size: int = 320, held_out_fraction: float = 0.25):
    """(tokenizer dir, corpus dir) under out_dir."""
    from .corpus import build_corpus, iter_texts
    from .tokenizer import train_tokenizer
    out_dir = Path(out_dir)
    tok = train_tokenizer(iter_texts([src_dir], held_out_fraction=held_out_fraction), vocab_size,
                          out_dir / "tokenizer")
    build_corpus([src_dir], tok, out_dir / "corpus", held_out_fraction=held_out_fraction)
    return out_dir / "tokenizer", out_dir / "corpus"


def tiny_setup(steps: int = 40, seed: int = 0, **train_overrides):
    """(TrainConfig, LMTrainSpec) for a seconds-long run of the 'tiny' model on one device."""
    from .lm import LMTrainSpec
    from .trainer import TrainConfig
    kw = dict(steps=steps, learning_rate=3e-3, warmup_steps=min(5, steps - 1), seed=seed,
              log_every=5, eval_every=10, checkpoint_every=10, keep_checkpoints=2, data_parallel=1,
              progress=False)
    kw.update(train_overrides)
    return TrainConfig(**kw), LMTrainSpec(batch_size=8, seq_len=32, eval_batch_size=8, eval_max_batches=2)


def build_tiny_lm(out_dir, steps: int = 40, seed: int = 0) -> Path:
    """A trained tiny LM exported as an HF directory (with tokenizer) at out_dir/model."""
    from .lm import model_config, train_lm
    from .tokenizer import eos_id, load_tokenizer_dir
    out_dir = Path(out_dir)
    src = write_tiny_sources(out_dir / "src")
    tok_dir, corpus_dir = build_tiny_corpus(src, out_dir)
    tok = load_tokenizer_dir(tok_dir)
    tcfg, spec = tiny_setup(steps, seed)
    config = model_config("tiny", len(tok), 128, eos_id(tok))
    train_lm(corpus_dir, tok_dir, config, tcfg, out_dir / "run", spec=spec, export_dir=out_dir / "model")
    return out_dir / "model"
