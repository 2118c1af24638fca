"""Bits per byte of a causal LM against general-purpose compressors, file by file.

A language model is a compressor (arithmetic coding turns -log2 p of each token into that many bits,
to within a few bits per file), so its cross-entropy over a file's tokens, divided by the file's
UTF-8 bytes, compares directly with bz2 / gzip / xz output sizes. To keep the comparison honest:

- every file is scored on its own (the model never sees another file's text as context), each token
  conditioned on at most `context` earlier tokens of its file, by a sliding window with stride
  `context // 2` that scores every token exactly once (`window_plan`);
- the first token is conditioned on `<|endoftext|>` only, as the corpus separates documents with it;
  that separator itself is not scored (the compressors' per-file headers are counted, so this
  slightly favours the model: a real coder would spend a few bits to code the end of the file);
- compressors are run on the same files, per file (sizes summed) and over the whole split as one
  stream (which lets them reuse one file's text for the next: the model cannot, so that row is a
  stronger baseline than the model's setting).

Splits: the held-out files of the CPython standard library (`heldout_stdlib_files`, the split the
embedded target never trained on) and a fixed sample of installed packages' sources that are outside
that corpus altogether (`outside_files`).
"""
from __future__ import annotations

import bz2
import dataclasses
import gzip
import hashlib
import lzma
import math
from pathlib import Path
from collections.abc import Sequence

import numpy as np

# Packages whose sources no shipped model or drafter trained on (benchmarks/_common reads this too).
OUTSIDE_PACKAGES = ("optax", "flax", "safetensors", "tqdm")
OUTSIDE_BYTES = 300_000  # size of the fixed outside-corpus sample
OUTSIDE_SALT = "jaxdecode-outside"


@dataclasses.dataclass(frozen=True)
class SourceFile:
    name: str   # path relative to its root (package or stdlib), for display only
    data: bytes  # the file's UTF-8 bytes


# ----------------------------------------------------------------------------- the files
def heldout_stdlib_files(root: str | None = None, held_out_fraction: float | None = None) -> list[SourceFile]:
    """The held-out split of the embedded corpus: stdlib `*.py` files whose salted path hash falls in
    the held-out fraction (`corpus.split_of`), non-empty UTF-8 only, sorted by relative path."""
    import sysconfig

    from .corpus import find_source_files, read_text, split_of
    from .recipe import HELD_OUT_FRACTION
    root = root or sysconfig.get_paths()["stdlib"]
    frac = HELD_OUT_FRACTION if held_out_fraction is None else held_out_fraction
    out = []
    for path, rel in find_source_files([root]):
        if split_of(rel, frac) != "heldout":
            continue
        text, _ = read_text(path)
        if text:
            out.append(SourceFile(rel, text.encode("utf-8")))
    if not out:
        raise FileNotFoundError(f"no held-out *.py files under {root}: is it a Python standard library?")
    return out


def outside_files(packages: Sequence[str] = OUTSIDE_PACKAGES, budget_bytes: int = OUTSIDE_BYTES,
                  salt: str = OUTSIDE_SALT) -> tuple[list[SourceFile], dict]:
    """(files, installed versions): a fixed sample of the packages' non-empty UTF-8 `*.py` files.

    Files are taken in the order of a salted hash of "package/relative path" until `budget_bytes`
    is reached, so the sample does not depend on file-system order and stays mostly the same when a
    package version adds or removes files; returned sorted by name.
    """
    import importlib
    import importlib.metadata

    from .corpus import read_text
    found, versions = [], {}
    for name in packages:
        try:
            root = Path(importlib.import_module(name).__file__).parent
        except ImportError:
            continue
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
        for path in sorted(root.rglob("*.py")):
            rel = f"{name}/{path.relative_to(root).as_posix()}"
            found.append((hashlib.sha256(f"{salt}:{rel}".encode()).hexdigest(), rel, path))
    if not found:
        raise RuntimeError(f"none of {list(packages)} is installed: no outside-corpus files to score")
    out, total = [], 0
    for _, rel, path in sorted(found):
        if total >= budget_bytes:
            break
        text, _ = read_text(path)
        if text:
            out.append(SourceFile(rel, text.encode("utf-8")))
            total += len(out[-1].data)
    return sorted(out, key=lambda f: f.name), versions


# ----------------------------------------------------------------------------- compressors
COMPRESSORS = {
    "bz2 -9": lambda b: bz2.compress(b, 9),
    "gzip -9": lambda b: gzip.compress(b, 9, mtime=0),
    "xz -9e": lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME),
}


def compressor_bits_per_byte(files: Sequence[SourceFile]) -> dict:
    """{"<name> per file": bits/byte, "<name> whole": bits/byte} for each compressor: per file = the
    sum of the files' compressed sizes; whole = the files concatenated in order, compressed once."""
    n = sum(len(f.data) for f in files)
    whole = b"".join(f.data for f in files)
    out = {}
    for name, fn in COMPRESSORS.items():
        out[f"{name} per file"] = 8 * sum(len(fn(f.data)) for f in files) / n
        out[f"{name} whole"] = 8 * len(fn(whole)) / n
    return out


# ----------------------------------------------------------------------------- the model
def window_plan(n: int, context: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored) of each window over a sequence of n tokens (seq[0] the separator).

    Window `start` feeds seq[start : start + context] and predicts seq[start + 1 : start + context + 1]
    (clipped at n); it scores the targets from `first scored` to its last one, i.e. those no earlier
    window scored. Targets 1 .. n-1 are each scored exactly once; target j is conditioned on
    seq[start : j], at most `context` tokens, and at least context - stride + 1 after the first window.
    """
    if not 0 < stride <= context:
        raise ValueError(f"the stride must be in [1, context={context}], got {stride}")
    plan, scored, start = [], 0, 0  # scored: the last target index scored so far
    while scored < n - 1:
        last = min(start + context, n - 1)
        plan.append((start, scored + 1))
        scored = last
        start += stride
    return plan


def _windows(seqs: Sequence[np.ndarray], context: int, stride: int):
    """(tokens [W, context + 1], weights [W, context], file index [W]) of every window of every file;
    positions past a file's end are padded with its separator at weight 0."""
    rows, weights, owner = [], [], []
    for i, seq in enumerate(seqs):
        for start, first in window_plan(len(seq), context, stride):
            piece = seq[start:start + context + 1]
            toks = np.full(context + 1, seq[0], np.int32)
            toks[:len(piece)] = piece
            w = np.zeros(context, np.float32)
            w[first - start - 1:len(piece) - 1] = 1.0  # target start + 1 + k sits at column k
            rows.append(toks)
            weights.append(w)
            owner.append(i)
    return np.stack(rows), np.stack(weights), np.asarray(owner)


def _row_nll_fn(config):
    """jit(params, tokens [B, T+1], weights [B, T]) -> summed nats per row [B]."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdecode.models import causal_mask, forward

    @jax.jit
    def row_nll(params, toks, w):
        inp = toks[:, :-1]
        b, t = inp.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _, _ = forward(config, params, inp, pos, None, causal_mask(b, t))  # [B, T, V]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), toks[:, 1:])
        return jnp.sum(nll * w, axis=1)
    return row_nll


def model_file_nats(config, params, tokenizer, files: Sequence[SourceFile], context: int,
                    stride: int | None = None, batch_size: int = 8, progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(nats [F], tokens [F]) of each file under the model, scored per file with `window_plan`."""
    from .tokenizer import eos_id
    if context > config.max_position_embeddings:
        raise ValueError(f"context={context} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}; pass a shorter context")
    stride = stride or max(context // 2, 1)
    sep = eos_id(tokenizer)
    encs = tokenizer.backend_tokenizer.encode_batch([f.data.decode("utf-8") for f in files],
                                                    add_special_tokens=False)
    seqs = [np.asarray([sep] + e.ids, np.int32) for e in encs]
    toks, w, owner = _windows(seqs, context, stride)
    pad = -len(toks) % batch_size  # whole batches only: one compiled shape
    toks = np.concatenate([toks, np.full((pad, context + 1), sep, np.int32)])
    w = np.concatenate([w, np.zeros((pad, context), np.float32)])
    row_nll = _row_nll_fn(config)
    nats = np.zeros(len(toks))
    for b0 in range(0, len(toks), batch_size):
        nats[b0:b0 + batch_size] = np.asarray(row_nll(params, toks[b0:b0 + batch_size], w[b0:b0 + batch_size]))
        if progress:
            progress(b0 + batch_size, len(toks))
    per_file = np.bincount(owner, weights=nats[:len(owner)], minlength=len(files))
    counts = np.asarray([len(s) - 1 for s in seqs])
    if not np.isclose(w.sum(), counts.sum()):  # every token of every file scored exactly once
        raise AssertionError(f"scored {w.sum()} tokens of {counts.sum()}")
    return per_file, counts


def model_bits_per_byte(config, params, tokenizer, files: Sequence[SourceFile], context: int,
                        stride: int | None = None, batch_size: int = 8, progress=None) -> dict:
    nats, counts = model_file_nats(config, params, tokenizer, files, context, stride, batch_size, progress)
    n_bytes = sum(len(f.data) for f in files)
    return {"bits_per_byte": float(nats.sum() / math.log(2) / n_bytes),
            "nats_per_token": float(nats.sum() / counts.sum()), "tokens": int(counts.sum())}


def compare(model_dir, splits: dict[str, Sequence[SourceFile]], context: int, stride: int | None = None,
            batch_size: int = 8, progress=None, params=None) -> dict:
    """{split: {"files", "bytes", "model" (bits/byte etc.), "<compressor> per file|whole": bits/byte}}
    for the HF model in `model_dir` (its weights as stored, computed in float32; `params` replaces the
    weights, e.g. a training checkpoint's)."""
    from jaxdecode.models import load_params

    from .tokenizer import load_tokenizer_dir
    config, stored = load_params(model_dir, dtype="float32")
    tokenizer = load_tokenizer_dir(model_dir)
    out = {}
    for name, files in splits.items():
        row = {"files": len(files), "bytes": sum(len(f.data) for f in files),
               "context": context, "stride": stride or max(context // 2, 1)}
        row["model"] = model_bits_per_byte(config, stored if params is None else params, tokenizer, files,
                                           context, stride, batch_size,
                                           (lambda i, n, s=name: progress(s, i, n)) if progress else None)
        row.update(compressor_bits_per_byte(files))
        out[name] = row
    return out
