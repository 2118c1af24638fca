"""Byte-level BPE tokenizers, trained with the `tokenizers` library and saved for AutoTokenizer.

Byte-level means every byte sequence has an encoding, so any source file round-trips exactly.
`<|endoftext|>` is the only special token: EOS, BOS, padding and the document separator of corpora.

A trained tokenizer directory is written whole or not at all (a temporary sibling, renamed when
complete) and holds `jaxdecode_tokenizer.json`: how it was trained, so a later run can tell whether
it fits (`trained_with`).
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Iterable

from .files import save_whole

EOS_TOKEN = "<|endoftext|>"
# 256 byte symbols + the special token: anything smaller cannot hold the byte alphabet.
MIN_VOCAB_SIZE = 257
# How a tokenizer directory was trained (vocab_size, min_frequency and the caller's `record`).
TRAINED_WITH = "jaxdecode_tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer cannot be trained or loaded, or does not fit the model or corpus."""


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir=None, min_frequency: int = 2,
                    record: dict | None = None):
    """Train a byte-level BPE on `texts`; save to `out_dir` (AutoTokenizer-loadable) if given, with
    `record` (e.g. the sources it was trained on) in its TRAINED_WITH file.

    Returns a `transformers.PreTrainedTokenizerFast`. Warns when the texts hold too few distinct
    pairs to reach `vocab_size` (the tokenizer is then smaller).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
                             f"{MIN_VOCAB_SIZE} tokens (256 bytes + {EOS_TOKEN}); use 4096 or more")
    seen = {"chars": 0}

    def counted():
        for t in texts:
            seen["chars"] += len(t)
            yield t

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(counted(), trainer)
    if seen["chars"] == 0:
        raise TokenizerError("cannot train a tokenizer on an empty corpus: no text was given "
                             "(check the corpus paths and file patterns)")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, unk_token=None)
    if len(fast) < vocab_size:
        warnings.warn(f"the tokenizer has only {len(fast)} tokens of the vocab_size={vocab_size} asked: "
                      f"its {seen['chars']} characters of text hold too few repeated pairs for more merges",
                      stacklevel=2)
    if out_dir is not None:
        info = {"vocab_size": vocab_size, "min_frequency": min_frequency, **(record or {})}
        save_whole(Path(out_dir), lambda d: (fast.save_pretrained(str(d)),
                                             (d / TRAINED_WITH).write_text(json.dumps(info, indent=1))))
    return fast


def trained_with(tok_dir) -> dict | None:
    """The TRAINED_WITH record of a tokenizer directory, or None (not trained by train_tokenizer,
    trained by an older jaxdecode, or unreadable)."""
    try:
        info = json.loads((Path(tok_dir) / TRAINED_WITH).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def load_tokenizer_dir(path):
    """AutoTokenizer from a local directory, offline, with a clear error if there is none (and a
    CheckpointError naming the directory if its files do not load)."""
    from jaxdecode.models.hf import load_tokenizer
    path = Path(path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise TokenizerError(f"the tokenizer directory {path} {what}; pass a directory holding "
                             f"tokenizer.json (a model's HF directory, or one made by `jaxdecode train lm`)")
    tok = load_tokenizer(path)
    if tok is None:
        raise TokenizerError(f"{path} holds no tokenizer (tokenizer.json); train one with "
                             f"`jaxdecode train lm --vocab-size N` or pass a tokenizer directory")
    return tok


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and merges: two tokenizers with equal fingerprints encode alike."""
    backend = tokenizer.backend_tokenizer
    return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]


def eos_id(tokenizer) -> int:
    tid = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if tid is None or tid == tokenizer.unk_token_id:
        raise TokenizerError(f"the tokenizer has no {EOS_TOKEN!r} token, which corpora use as the "
                             f"document separator; train it with train_tokenizer")
    return int(tid)


def check_vocab(tokenizer, vocab_size: int, what: str = "the model") -> None:
    """The model's embedding must have a row for every token id the tokenizer can emit."""
    n = len(tokenizer)
    if n > vocab_size:
        raise TokenizerError(f"tokenizer/model vocabulary mismatch: the tokenizer has {n} tokens but "
                             f"{what} has vocab_size={vocab_size}; use a model with vocab_size >= {n} "
                             f"or the tokenizer it was trained with")
