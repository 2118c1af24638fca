"""jaxdecode.training: Flax NNX + optax + orbax training of LMs, drafters, heads and filters.

    trainer      the general loop (jit step, AdamW + warmup/cosine + clipping, eval, JSONL log,
                 tqdm, orbax checkpoints with exact resume, data parallel / FSDP over a mesh)
    corpus       files -> tokenized memmap shards, split by path hash, batch sources
    tokenizer    byte-level BPE training, saved for transformers.AutoTokenizer
    files        artefacts (tokenizer, corpus, export) written whole or not at all
    lm           causal LMs from scratch or distilled; HF export; held-out evaluation
    baselines    add-k unigram / bigram baselines
    fixtures     tiny corpora and models for tests, built by the same code
    cli          `jaxdecode train lm ...`
    build_embedded / report   the shipped models in models/embedded and their card

Nothing in the decoding package imports this one: import it explicitly.
"""
from .corpus import Corpus, CorpusError, WindowSampler, build_corpus, eval_batches, find_source_files
from .lm import CausalLM, DistillLoss, LMTrainSpec, export_lm, lm_eval_step, lm_loss, model_config, train_lm
from .tokenizer import TokenizerError, load_tokenizer_dir, train_tokenizer
from .trainer import (CheckpointCorruptError, CheckpointFallbackWarning, ResumeMismatchError, TrainConfig,
                      TrainConfigError, TrainResult, make_mesh, make_optimizer, read_metrics, restore_latest,
                      train)

__all__ = [
    "Corpus", "CorpusError", "WindowSampler", "build_corpus", "eval_batches", "find_source_files",
    "CausalLM", "DistillLoss", "LMTrainSpec", "export_lm", "lm_eval_step", "lm_loss", "model_config",
    "train_lm", "TokenizerError", "load_tokenizer_dir", "train_tokenizer", "CheckpointCorruptError",
    "CheckpointFallbackWarning", "ResumeMismatchError",
    "TrainConfig", "TrainConfigError", "TrainResult", "make_mesh", "make_optimizer", "read_metrics",
    "restore_latest", "train",
]
