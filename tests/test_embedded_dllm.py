"""The embedded diffusion LM (models/embedded/dllm): the target adapted Dream-style; found by name,
decoded by method="diffusion" (the CLI's default model for it), and a drafter for the target."""
import json

import pytest

import jaxdecode


@pytest.fixture(scope="module")
def dllm():
    return jaxdecode.load("dllm")


def test_the_embedded_dllm_is_the_targets_dream_style_adaptation(dllm):
    target = jaxdecode.load("target")
    c = dllm.config
    assert c.is_diffusion and c.attention == "bidirectional" and c.logits_shift == 1
    assert c.vocab_size == target.config.vocab_size + 1 == c.mask_token_id + 1  # <|mask|> appended
    assert dllm.tokenizer.mask_token_id == c.mask_token_id
    text = "def add(a, b):\n    return a + b\n"
    assert dllm.tokenizer.encode(text) == target.tokenizer.encode(text)  # same ids for every other token


def test_diffusion_decodes_it_and_the_cli_defaults_to_it(dllm, capsys):
    from jaxdecode.cli import main
    res = jaxdecode.generate(dllm, ["import os\n", "def f(x):\n"], method="diffusion", max_new_tokens=8,
                             rule="threshold", eos_ids=())
    assert [len(r.tokens) for r in res] == [8, 8] and all(1 <= r.stats["nfe"] <= 8 for r in res)
    one = jaxdecode.generate(dllm, "import os\n", method="diffusion", max_new_tokens=8, rule="threshold")
    assert main(["generate", "--method", "diffusion", "--prompt", "import os\n", "--max-new-tokens", "8",
                 "--rule", "threshold", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert row["tokens"] == one[0].tokens  # the same model, found without --model


def test_it_drafts_for_the_target_losslessly(dllm):
    target = jaxdecode.load("target")
    prompts = ["import os\n", "class A:\n    def"]
    plain = jaxdecode.generate(target, prompts, method="greedy", max_new_tokens=8)
    spec = jaxdecode.generate(target, prompts, method="speculative", drafter="dllm", draft=dllm, tree="chain:4",
                              max_new_tokens=8, adaptive=False)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]


def test_no_left_to_right_scoring_of_a_diffusion_lm(dllm):
    with pytest.raises(ValueError, match="masked-diffusion"):
        jaxdecode.score(dllm, "import os\n")
    with pytest.raises(ValueError, match="masked-diffusion"):
        jaxdecode.generate(dllm, "import os\n", method="diffusion", max_new_tokens=4, echo=True)


def test_unfinished_rows_are_not_valid(dllm):
    """max_forwards too small for the answer: MASK slots remain, so the row is 'unfinished' and its text (which
    leaves the MASK holes out) is never reported valid."""
    mask = dllm.config.mask_token_id
    r = jaxdecode.generate(dllm, ["def f(x):\n    return "], method="diffusion", regex="[0-9]+", max_new_tokens=8,
                           max_forwards=3)[0]
    assert mask in r.tokens and r.stats["unfinished"] and r.stats["constraint_unmatched"]
    assert r.finish_reason == "unfinished" and r.valid is False
    done = jaxdecode.generate(dllm, ["def f(x):\n    return "], method="diffusion", regex="[0-9]+",
                              max_new_tokens=8)[0]
    assert mask not in done.tokens and not done.stats["unfinished"]
    assert done.finish_reason in ("eos", "length") and done.valid is True
