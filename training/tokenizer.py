"""Byte-level BPE tokenizers, trained with the `tokenizers` library and saved for AutoTokenizer.

Byte-level means every byte sequence has an encoding, so any source file round-trips exactly.
`<|endoftext|>` is the only special token: EOS, BOS, padding and the document separator of corpora.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

EOS_TOKEN = "<|endoftext|>"
# 256 byte symbols + the special token: anything smaller cannot hold the byte alphabet.
MIN_VOCAB_SIZE = 257


class TokenizerError(ValueError):
    """A tokenizer cannot be trained or loaded, or does not fit the model or corpus."""


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir=None, min_frequency: int = 2):
    """Train a byte-level BPE on `texts`; save to `out_dir` (AutoTokenizer-loadable) if given.

    Returns a `transformers.PreTrainedTokenizerFast`.
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
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer_dir(path):
    """AutoTokenizer from a local directory, offline, with a clear error if there is none."""
    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise TokenizerError(f"{path} holds no tokenizer (tokenizer.json); train one with "
                             f"`jaxdecode train lm --tokenizer-size N` or pass a tokenizer directory")
    from transformers import AutoTokenizer
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


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
