"""Count-based baselines on the same tokenizer: add-k unigram and bigram models.

Scored on exactly the tokens the LM evaluation scores (the weighted next-token positions of the
same held-out batches, EOS separators included), so nats/token and bits/byte compare like for
like. k is chosen from a small grid on those held-out tokens themselves, which can only flatter
the baselines.
"""
from __future__ import annotations

import math

import numpy as np

K_GRID = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (byte-level BPE: one symbol per byte; specials: 0)."""
    n = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    toks = tokenizer.convert_ids_to_tokens(list(range(n)))
    return np.asarray([0 if i in special else len(t) for i, t in enumerate(toks)], np.int64)


def scored_pairs(batches) -> tuple[np.ndarray, np.ndarray]:
    """(previous token, next token) of every scored position of LM eval batches."""
    prev, nxt = [], []
    for b in batches:
        w = b["weights"] > 0
        prev.append(b["tokens"][:, :-1][w])
        nxt.append(b["tokens"][:, 1:][w])
    return np.concatenate(prev).astype(np.int64), np.concatenate(nxt).astype(np.int64)


def _score(nll: float, n_tokens: int, num_bytes: int) -> dict:
    return {"nats_per_token": nll / n_tokens, "bits_per_byte": nll / math.log(2) / num_bytes}


def bigram_counts(train: np.ndarray, vocab_size: int) -> np.ndarray:
    pairs = train[:-1].astype(np.int64) * vocab_size + train[1:].astype(np.int64)
    return np.bincount(pairs, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size)


def ngram_baselines(train: np.ndarray, batches, vocab_size: int, byte_lengths: np.ndarray) -> dict:
    """{"unigram": {...}, "bigram": {...}}: nats/token, bits/byte and the chosen k of each."""
    prev, nxt = scored_pairs(batches)
    n, n_bytes = len(nxt), int(byte_lengths[nxt].sum())
    uni_counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    pair_counts = bigram_counts(train, vocab_size)
    ctx = pair_counts.sum(axis=1).astype(np.float64)
    c_pair = pair_counts[prev, nxt].astype(np.float64)

    def uni(k):
        return float(-(np.log(uni_counts[nxt] + k) - np.log(uni_counts.sum() + k * vocab_size)).sum())

    def bi(k):
        return float(-(np.log(c_pair + k) - np.log(ctx[prev] + k * vocab_size)).sum())
    out = {}
    for name, fn in (("unigram", uni), ("bigram", bi)):
        scores = {k: fn(k) for k in K_GRID}
        k = min(scores, key=scores.get)
        out[name] = {**_score(scores[k], n, n_bytes), "k": k}
    return out
