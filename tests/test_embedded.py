"""The shipped embedded models: they load, and speculative decoding on them is exact."""
import numpy as np
import pytest

import jaxdecode
from jaxdecode.api import embedded_model_path

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(", "    return self."]


@pytest.fixture(scope="module")
def embedded():
    assert embedded_model_path("target") and embedded_model_path("draft"), \
        "models/embedded/{target,draft} must be shipped (make models)"
    return jaxdecode.load("target"), jaxdecode.load("draft")


def test_embedded_models_share_a_tokenizer(embedded):
    target, draft = embedded
    assert target.config.vocab_size == draft.config.vocab_size
    assert target.encode(PROMPTS[0]) == draft.encode(PROMPTS[0])
    assert target.decode(target.encode(PROMPTS[1])) == PROMPTS[1]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("opts", [dict(tree="chain:4"), dict(tree="eagle:depth=4,topk=3,total=10"),
                                  pytest.param(dict(drafter="prompt_lookup", tree="chain:5"),
                                               marks=pytest.mark.real_costs)],
                         ids=["draft_chain", "draft_eagle", "prompt_lookup"])
def test_greedy_speculative_equals_greedy_on_embedded_models(embedded, batch, opts):
    target, draft = embedded
    prompts = PROMPTS[:batch]
    plain = jaxdecode.generate(target, prompts, method="greedy", max_new_tokens=24, eos_ids=())
    extra = {"draft": draft} if "drafter" not in opts else {}
    # Batch 4 runs the default (adaptive), batch 1 the fixed configuration. At batch 4 prompt_lookup measures
    # its cost table on the embedded models (real_costs: 40-80 s of calibration, so one configuration does);
    # the draft LM's rows decide from the synthetic table.
    spec = jaxdecode.generate(target, prompts, method="speculative", max_new_tokens=24, eos_ids=(),
                              adaptive=batch > 1, **extra, **opts)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert np.mean([r.stats["tau"] for r in spec]) >= 1.0


def test_shipped_drafters_fit_the_model_file_budget():
    """The trained drafters shipped beside the embedded target stay within 20 MB on disk (issue 10's
    budget for model files), and each is a whole drafter directory that loads."""
    from jaxdecode.drafters.trained import read_drafter_config
    root = embedded_model_path("target") / "drafters"
    dirs = sorted(p for p in root.iterdir() if p.is_dir())
    assert dirs, f"{root} ships no drafters"
    size = sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())
    assert size <= 20e6, f"the shipped drafters take {size / 1e6:.1f} MB, over the 20 MB budget"
    for d in dirs:
        assert read_drafter_config(d)["jaxdecode_drafter"] == d.name
