"""training.compression (model vs compressors, per file) and the model card's portability."""
from __future__ import annotations

import bz2
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxdecode.models import causal_mask, forward, init_params
from jaxdecode.training import compression as C
from jaxdecode.training.lm import model_config
from jaxdecode.training.tokenizer import load_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "embedded"


@pytest.mark.parametrize("n,context,stride", [(2, 8, 4), (8, 8, 4), (9, 8, 4), (30, 8, 4), (30, 8, 8),
                                              (30, 8, 1), (100, 16, 5)])
def test_window_plan_scores_every_target_once_with_bounded_context(n, context, stride):
    seen = []
    for i, (start, first) in enumerate(C.window_plan(n, context, stride)):
        last = min(start + context, n - 1)
        for j in range(first, last + 1):
            assert 1 <= j - start <= context  # conditioned on seq[start:j]
            if i > 0:
                assert j - start >= context - stride + 1
        seen += range(first, last + 1)
    assert seen == list(range(1, n))


def test_window_plan_rejects_a_bad_stride():
    with pytest.raises(ValueError, match="stride"):
        C.window_plan(10, 8, 9)


@pytest.fixture(scope="module")
def tiny():
    """A random tiny model over the embedded tokenizer (the scores need not be good, only right)."""
    tok = load_tokenizer_dir(EMBEDDED / "target")
    config = model_config("tiny", len(tok), 64, 0)
    return config, init_params(config, jax.random.PRNGKey(3)), tok


def _naive_nats(config, params, seq, context, stride):
    """Each window of the plan on its own, unpadded, one forward per window."""
    total = 0.0
    for start, first in C.window_plan(len(seq), context, stride):
        piece = np.asarray(seq[start:start + context + 1], np.int32)[None]
        t = piece.shape[1] - 1
        logits, _, _ = forward(config, params, piece[:, :-1], np.arange(t, dtype=np.int32)[None], None,
                               causal_mask(1, t))
        logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
        for j in range(first, start + t + 1):
            total -= float(logp[j - start - 1, seq[j]])
    return total


def test_model_nats_match_window_by_window_scoring(tiny):
    config, params, tok = tiny
    files = [C.SourceFile("a.py", b"def f(x):\n    return x + 1\n" * 3), C.SourceFile("b.py", b"import os\n"),
             C.SourceFile("c.py", "s = 'caf\u00e9'\nprint(s)\n".encode())]
    nats, counts = C.model_file_nats(config, params, tok, files, context=8, stride=4, batch_size=4)
    for f, got, n in zip(files, nats, counts):
        seq = [0] + tok.backend_tokenizer.encode(f.data.decode(), add_special_tokens=False).ids
        assert n == len(seq) - 1
        np.testing.assert_allclose(got, _naive_nats(config, params, seq, 8, 4), rtol=2e-5)
    # one window covering the file = the whole file in one forward
    full, _ = C.model_file_nats(config, params, tok, files[:1], context=64)
    np.testing.assert_allclose(full[0], _naive_nats(config, params, [0] + tok.backend_tokenizer.encode(
        files[0].data.decode(), add_special_tokens=False).ids, 64, 64), rtol=2e-5)


def test_model_context_beyond_positions_is_refused(tiny):
    config, params, tok = tiny
    with pytest.raises(ValueError, match="max_position_embeddings"):
        C.model_file_nats(config, params, tok, [C.SourceFile("a.py", b"x = 1\n")], context=65)


def test_compressor_rows():
    files = [C.SourceFile("a.py", b"x = 1\n" * 50), C.SourceFile("b.py", b"y = 2\n" * 40)]
    got = C.compressor_bits_per_byte(files)
    n = 540
    assert got["bz2 -9 per file"] == pytest.approx(8 * sum(len(bz2.compress(f.data, 9)) for f in files) / n)
    assert got["bz2 -9 whole"] == pytest.approx(8 * len(bz2.compress(files[0].data + files[1].data, 9)) / n)
    assert set(got) == {f"{c} {k}" for c in C.COMPRESSORS for k in ("per file", "whole")}


ABSOLUTE = re.compile(r"(/root|/tmp|/home|/work|/Users|[A-Za-z]:\\)")


def test_model_card_names_no_path_of_the_machine_it_was_built_on():
    from jaxdecode.training.report import model_card
    card = (EMBEDDED / "MODEL_CARD.md").read_text()
    assert not ABSOLUTE.search(card), ABSOLUTE.search(card)
    metrics = json.loads((EMBEDDED / "metrics.json").read_text())
    assert not ABSOLUTE.search(json.dumps(metrics))
    # the card writer scrubs a report that carries machine paths (an old metrics.json, a command line)
    metrics["corpus_root"] = ["/root/.pyenv/versions/3.11.7/lib/python3.11"]
    metrics["command"] = "python -m jaxdecode.training.build_embedded --workdir /tmp/ship --out /work/x/models"
    assert not ABSOLUTE.search(model_card(metrics))
