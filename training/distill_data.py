"""Training data for drafters: corpus windows, the target's own continuations, or a mix of both.

    shard = self_distill_data(target, corpus_dir, cache_dir, DistillOptions(...))   # cached, resumable
    batches = make_batches("mix", corpus_dir, shard=shard, batch_size=16, seq_len=96, seed=0)
    batches(step) -> {"tokens": int32[B, T], "mask": f32[B, T]}        # a pure function of the step

Self-distillation: prompts are windows of the corpus's training split, continued by the target itself
(greedy for a fraction of the rows, sampled at `temperature` for the rest) with jaxdecode's batched
decoder, so a drafter learns the distribution it will be verified against. The generated rows are a
token shard (npz) plus a manifest under cache_dir/<key>, the key a hash of (target fingerprint, corpus,
options): the same request reuses the finished shard; an interrupted generation goes on from its last
finished chunk.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from .corpus import Corpus, CorpusError, WindowSampler

DATA_MODES = ("corpus", "self", "mix")
MANIFEST = "manifest.json"
SHARD = "tokens.npz"


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """How the target's own continuations are made."""
    num_prompts: int = 512  # rows generated (rounded up to whole batches)
    prompt_len: int = 32  # tokens of corpus text per prompt
    new_tokens: int = 64  # continuation length N
    temperature: float = 0.7  # of the sampled rows
    greedy_fraction: float = 0.5  # rows continued greedily (whole batches, the first ones)
    batch_size: int = 32  # rows per jit-compiled decode call
    seed: int = 0

    def __post_init__(self):
        for name in ("num_prompts", "prompt_len", "new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillOptions.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.greedy_fraction <= 1.0:
            raise ValueError(f"greedy_fraction must be in [0, 1], got {self.greedy_fraction}")
        if self.temperature <= 0 and self.greedy_fraction < 1:
            raise ValueError(f"temperature must be > 0 for the sampled rows, got {self.temperature} "
                             f"(all-greedy data: greedy_fraction=1)")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def num_batches(self) -> int:
        return -(-self.num_prompts // self.batch_size)


# ----------------------------------------------------------------------------- fingerprints
def target_fingerprint(target) -> str:
    """A hash that changes when the target's weights or config change: from its directory's files
    (config.json and weights: name, size, mtime) when it was loaded from one, else from its params."""
    h = hashlib.sha256()
    path = getattr(target, "path", None)
    if path is not None and Path(path).is_dir():
        for p in sorted(Path(path).iterdir()):
            if p.name == "config.json" or p.suffix == ".safetensors" or p.name.endswith(".index.json"):
                st = p.stat()
                h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return "files:" + h.hexdigest()[:16]
    import jax
    h.update(repr(target.config).encode())
    for leaf in jax.tree.leaves(target.params):
        h.update(np.asarray(leaf).tobytes())
    return "params:" + h.hexdigest()[:16]


def corpus_fingerprint(corpus: Corpus) -> str:
    m = corpus.manifest
    return f"{m['tokenizer_fingerprint']}:{m['splits']['train']['tokens']}:{m['splits']['heldout']['tokens']}"


def prompt_windows(tokens: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """int32[count, length]: windows of a token stream at starts drawn from (seed)."""
    if len(tokens) < length + 1:
        raise CorpusError(f"the corpus split has {len(tokens)} tokens: too few for prompts of {length}; "
                          f"use a shorter prompt length or more text")
    starts = np.random.default_rng([seed, 7]).integers(0, len(tokens) - length, size=count)
    return tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int32)


# ----------------------------------------------------------------------------- self-distillation
def _save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def self_distill_data(target, corpus_dir, cache_dir, options: DistillOptions = DistillOptions(), *,
                      split: str = "train", eos_ids: tuple | None = None, progress: bool = True) -> Path:
    """The npz shard of the target's continuations of corpus prompts (made now, or found in cache_dir).

    The shard holds "tokens" int32[R, prompt_len + new_tokens] and "mask" f32[R, same]: 1 on the prompt
    and the continuation up to and including its EOS, 0 after it. Returns the shard's path.
    """
    import jax

    from jaxdecode.autoregressive import decode
    from jaxdecode.sampling import SamplerConfig

    corpus = Corpus.open(corpus_dir)
    if target.config.max_position_embeddings < options.seq_len:
        raise ValueError(f"prompt_len + new_tokens = {options.seq_len} exceeds the target's "
                         f"max_position_embeddings {target.config.max_position_embeddings}")
    if eos_ids is None:
        eos_ids = tuple(target.config.eos_token_ids)
    key = {"target": target_fingerprint(target), "corpus": corpus_fingerprint(corpus), "split": split,
           "eos_ids": list(eos_ids), "options": dataclasses.asdict(options)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(cache_dir) / f"self-{digest}"
    shard = out / SHARD
    if (out / MANIFEST).exists() and shard.exists():
        return shard
    out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_windows(corpus.tokens(split), options.num_batches * options.batch_size,
                             options.prompt_len, options.seed)
    n_greedy = round(options.greedy_fraction * options.num_batches)
    lengths = np.full((options.batch_size,), options.prompt_len, np.int32)
    base_key = jax.random.key(options.seed)
    chunks = [out / f"chunk-{i:05d}.npz" for i in range(options.num_batches)]
    todo = [i for i, c in enumerate(chunks) if not c.exists()]
    if todo and len(todo) < len(chunks):
        print(f"self-distillation data: resuming at {len(chunks) - len(todo)}/{len(chunks)} chunks in {out}",
              file=sys.stderr)
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(chunks), initial=len(chunks) - len(todo), desc="self-distill", dynamic_ncols=True)
    try:
        for i in todo:
            rows = prompts[i * options.batch_size:(i + 1) * options.batch_size]
            greedy = i < n_greedy
            res = decode(target.config, target.params, rows, lengths, max_new_tokens=options.new_tokens,
                         sampler=SamplerConfig(temperature=0.0 if greedy else options.temperature),
                         eos_ids=eos_ids, key=jax.random.fold_in(base_key, i),
                         method="greedy" if greedy else "sample")
            gen = np.asarray(res.tokens)[:, :options.new_tokens]
            n = np.asarray(res.lengths)
            mask = np.concatenate([np.ones_like(rows, np.float32),
                                   (np.arange(options.new_tokens)[None, :] < n[:, None]).astype(np.float32)], 1)
            toks = np.concatenate([rows, np.where(mask[:, options.prompt_len:] > 0, gen, 0)], 1)
            _save_npz(chunks[i], tokens=toks.astype(np.int32), mask=mask, greedy=np.full(len(rows), greedy))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    parts = [np.load(c) for c in chunks]
    tokens = np.concatenate([p["tokens"] for p in parts])[:options.num_prompts]
    mask = np.concatenate([p["mask"] for p in parts])[:options.num_prompts]
    greedy = np.concatenate([p["greedy"] for p in parts])[:options.num_prompts]
    _save_npz(shard, tokens=tokens, mask=mask, greedy=greedy)
    _write_json(out / MANIFEST, {"key": key, "rows": int(len(tokens)), "seq_len": options.seq_len,
                                 "greedy_rows": int(greedy.sum()),
                                 "continuation_tokens": int(mask[:, options.prompt_len:].sum())})
    for c in chunks:
        c.unlink()
    return shard


def load_shard(path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32[R, T], mask f32[R, T]) of a self-distillation shard."""
    with np.load(path) as z:
        return z["tokens"].astype(np.int32), z["mask"].astype(np.float32)


# ----------------------------------------------------------------------------- batch sources
@dataclasses.dataclass(frozen=True, eq=False)
class CorpusBatches:
    """B random windows of T tokens of a token stream, all real: the LM trainer's WindowSampler
    (batch `step` depends on (seed, step) only) in the drafter batch format."""
    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        object.__setattr__(self, "_windows", WindowSampler(self.tokens, self.batch_size, self.seq_len - 1,
                                                           self.seed))

    def __call__(self, step: int) -> dict:
        toks = self._windows(step)["tokens"]  # [B, (T - 1) + 1]
        return {"tokens": toks, "mask": np.ones(toks.shape, np.float32)}


@dataclasses.dataclass(frozen=True, eq=False)
class ShardBatches:
    """B random rows of a (tokens, mask) shard; batch `step` depends on (seed, step) only."""
    tokens: np.ndarray
    mask: np.ndarray
    batch_size: int
    seed: int = 0

    def __call__(self, step: int) -> dict:
        rows = np.random.default_rng([self.seed, step, 1]).integers(0, len(self.tokens), size=self.batch_size)
        return {"tokens": self.tokens[rows], "mask": self.mask[rows]}


@dataclasses.dataclass(frozen=True, eq=False)
class MixBatches:
    """The first half of each batch from `a`, the rest from `b` (both of the same sequence length)."""
    a: object
    b: object

    def __call__(self, step: int) -> dict:
        x, y = self.a(step), self.b(step)
        return {k: np.concatenate([x[k], y[k]]) for k in ("tokens", "mask")}


def make_batches(data: str, corpus_dir, *, batch_size: int, seq_len: int, seed: int = 0, shard=None):
    """batches(step) of {"tokens" int32[B, T], "mask" f32[B, T]} for --data corpus|self|mix.

    self and mix need the self-distillation `shard` (its rows are T = prompt_len + new_tokens long,
    which must equal seq_len)."""
    if data not in DATA_MODES:
        raise ValueError(f"unknown data {data!r}; choose one of {', '.join(DATA_MODES)}")
    corpus = None if data == "self" else Corpus.open(corpus_dir).tokens("train")
    if data == "corpus":
        return CorpusBatches(corpus, batch_size, seq_len, seed)
    if shard is None:
        raise ValueError(f"data={data!r} needs the self-distillation shard (self_distill_data)")
    tokens, mask = load_shard(shard)
    if tokens.shape[1] != seq_len:
        raise ValueError(f"the self-distillation rows are {tokens.shape[1]} tokens long but seq_len is "
                         f"{seq_len}: use seq_len = prompt_len + new_tokens")
    if data == "self":
        return ShardBatches(tokens, mask, batch_size, seed)
    if batch_size < 2:
        raise ValueError("data='mix' needs batch_size >= 2 (half corpus, half self-distillation rows)")
    half = batch_size // 2
    return MixBatches(CorpusBatches(corpus, half, seq_len, seed), ShardBatches(tokens, mask, batch_size - half, seed))


def lm_batches(batches):
    """A drafter batch source as a train_lm one: {"tokens" [B, T], "weights" [B, T-1]} (position t
    predicts token t+1, weighted by whether t+1 is real)."""
    def fn(step: int) -> dict:
        b = batches(step)
        return {"tokens": b["tokens"], "weights": b["mask"][:, 1:] * b["mask"][:, :-1]}
    return fn
