"""`jaxdecode train eagle3 --set draft_vocab=M`: a trimmed draft vocabulary from the training text."""
from types import SimpleNamespace

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a stand-in target: only its config is read, corpus dir) without training a model."""
    from jaxdecode.training.lm import model_config
    from jaxdecode.training.fixtures import build_tiny_corpus, write_tiny_sources
    from jaxdecode.training.tokenizer import load_tokenizer_dir
    root = tmp_path_factory.mktemp("tiny")
    tok_dir, corpus = build_tiny_corpus(write_tiny_sources(root / "src"), root)
    config = model_config("tiny", len(load_tokenizer_dir(tok_dir)), 128, 0)
    return SimpleNamespace(config=config), corpus


def test_an_integer_draft_vocab_becomes_the_most_frequent_training_ids(tiny):
    from jaxdecode.training.corpus import Corpus
    from jaxdecode.training.drafters import get_train_kind
    target, corpus = tiny
    resolve = get_train_kind("eagle3").resolve_overrides
    out = resolve({"draft_vocab": 16, "ttt_steps": 2}, target, corpus)
    vocab = out["draft_vocab"]
    assert out["ttt_steps"] == 2 and len(vocab) == 16 and list(vocab) == sorted(vocab)
    assert set(target.config.eos_token_ids) <= set(vocab)  # EOS stays draftable
    counts = np.bincount(np.asarray(Corpus.open(corpus).tokens("train")).ravel(), minlength=target.config.vocab_size)
    rest = [i for i in vocab if i not in target.config.eos_token_ids]
    others = np.delete(counts, list(vocab))
    assert counts[rest].min() >= others.max()  # nothing left out is more frequent than what is kept
    ids = (3, 1, 2)
    assert resolve({"draft_vocab": ids}, target, corpus)["draft_vocab"] == ids  # explicit ids pass unchanged
    cfg = get_train_kind("eagle3").default_config(target.config, **out)
    assert tuple(cfg.draft_vocab) == tuple(vocab)
    for bad in (0, target.config.vocab_size + 1):
        with pytest.raises(ValueError, match="draft_vocab="):
            resolve({"draft_vocab": bad}, target, corpus)
