"""Public surface: jaxdecode.load / generate / methods and the `jaxdecode` CLI."""
import json

import pytest

import jaxdecode
from jaxdecode.cli import main


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return jaxdecode.load(tiny_llama_dir)


def test_load_and_generate_text(model):
    assert model.tokenizer is not None and model.config.model_type == "llama"
    out = jaxdecode.generate(model, ["def add(a, b):", "import"], method="greedy", max_new_tokens=5,
                             eos_ids=())
    assert len(out) == 2
    for r in out:
        assert r.stats["new_tokens"] == 5 == len(r.tokens)
        assert r.batch_stats["target_calls"] == 5  # prefill (gives the first token) + 4 decode steps
        assert r.batch_stats["seconds"] > 0
        assert r.text == model.decode(r.tokens)


def test_every_registered_method_runs(model):
    names = jaxdecode.methods()
    for required in ("greedy", "sample", "mirostat", "beam", "diverse_beam"):
        assert required in names
    for method, opts in [("sample", dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.01,
                                         repetition_penalty=1.2)),
                         ("mirostat", dict(tau=3.0)), ("beam", dict(num_beams=3)),
                         ("diverse_beam", dict(num_beams=4, num_groups=2, diversity_penalty=1.0))]:
        out = jaxdecode.generate(model, [[5, 6, 7], [8]], method=method, max_new_tokens=4, **opts)
        assert [len(r.tokens) for r in out] == [r.stats["new_tokens"] for r in out]


def test_generate_is_deterministic_given_seed(model):
    a = jaxdecode.generate(model, "def f(", method="sample", max_new_tokens=6, seed=4, eos_ids=())
    b = jaxdecode.generate(model, "def f(", method="sample", max_new_tokens=6, seed=4, eos_ids=())
    assert a[0].tokens == b[0].tokens


def test_generate_bad_input(model):
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        jaxdecode.generate(model, "x", method="nope")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        jaxdecode.generate(model, ["x", ""], method="greedy")
    with pytest.raises(ValueError, match="does not take option"):
        jaxdecode.generate(model, "x", method="greedy", num_beams=3)
    with pytest.raises(ValueError, match=r"vocab"):
        jaxdecode.generate(model, [[1, 2, 10_000]], method="greedy")
    with pytest.raises(ValueError, match="not a directory"):
        jaxdecode.load("/nonexistent/dir")


def test_prompts_as_arrays(model):
    """A 2-D integer array is a batch (one prompt per row), a 1-D one a prompt; float arrays are refused,
    not truncated to ids."""
    import jax.numpy as jnp
    import numpy as np
    kw = dict(method="greedy", max_new_tokens=3, eos_ids=())
    want = [r.tokens for r in jaxdecode.generate(model, [[5, 6, 7], [8, 9, 10]], **kw)]
    assert [r.tokens for r in jaxdecode.generate(model, np.array([[5, 6, 7], [8, 9, 10]]), **kw)] == want
    assert [r.tokens for r in jaxdecode.generate(model, [np.array([5, 6, 7]), jnp.array([8, 9, 10])], **kw)] == want
    assert jaxdecode.generate(model, jnp.array([5, 6, 7], jnp.int32), **kw)[0].tokens == want[0]
    with pytest.raises(ValueError, match="array of float64: token ids must be integers"):
        jaxdecode.generate(model, np.array([5.7, 6.2]), **kw)
    with pytest.raises(ValueError, match="prompt 1 is an array of float32"):
        jaxdecode.generate(model, [[5], np.array([1.0], np.float32)], **kw)
    with pytest.raises(ValueError, match="3-D array of shape"):
        jaxdecode.generate(model, np.zeros((1, 2, 3), np.int32), **kw)


def test_cli_generate_json(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "def add(", "--prompt",
               "class", "--method", "greedy", "--max-new-tokens", "4", "--json"])
    assert rc == 0
    *lines, last = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines] == ["def add(", "class"]
    for x in lines:
        assert set(x) == {"prompt", "text", "tokens", "finish_reason", "stats"}
        assert {"new_tokens", "nonfinite_logits"} <= set(x["stats"]) and "seconds" not in x["stats"]
    # The whole call's figures once, on a last line.
    assert {"target_calls", "seconds", "compile_seconds", "batch_size"} <= set(last["batch_stats"])


def test_cli_param_dtype(tiny_llama_dir, capsys):
    """--param-dtype bfloat16 (weights narrower, float32 compute) generates what the library call does."""
    import jaxdecode
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "def add(", "--method", "greedy",
               "--max-new-tokens", "6", "--param-dtype", "bfloat16", "--json"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    m = jaxdecode.load(tiny_llama_dir, param_dtype="bfloat16")
    assert row["tokens"] == jaxdecode.generate(m, ["def add("], max_new_tokens=6, method="greedy")[0].tokens
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--param-dtype", "int8"])


def test_cli_prompts_file_and_sampling(tiny_llama_dir, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("import os\n\nfor i in\n")
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompts-file", str(f), "--method",
               "sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "1",
               "--max-new-tokens", "3", "--json"])
    assert rc == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2 + 1  # + the batch_stats line


def test_cli_errors_are_clear(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--method", "nope"])
    assert rc == 2 and "unknown method 'nope'" in capsys.readouterr().err
    rc = main(["generate", "--model", "/nonexistent", "--prompt", "x"])
    assert rc == 2 and "error" in capsys.readouterr().err


def test_cli_eos_ids_as_the_help_says(tiny_llama_dir, capsys):
    """--eos-id takes one id, several comma-separated, or [] for none (the option's own "[] = none")."""
    def tokens(*flags):
        assert main(["generate", "--model", str(tiny_llama_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
                     "--json", *flags]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out.splitlines()[0])["tokens"]
    free = tokens("--eos-id", "[]")
    assert len(free) == 6
    assert tokens("--eos-id", f"{free[1]},{free[3]}") == free[:2]
    assert tokens("--eos-id", str(free[3]), "--eos-id", str(free[2])) == free[:3]
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--eos-id", "two"])
    assert "expected token ids such as 7, 7,9 or []" in capsys.readouterr().err


# ----------------------------------------------------------------------------- option values
@pytest.mark.parametrize("method, opts, match", [
    ("sample", dict(top_p=0), r"top_p must be .* \(0, 1\]"),
    ("sample", dict(top_p=1.5), "top_p"),
    ("beam", dict(num_beams=0), "num_beams must be an int >= 1"),
    ("sample", dict(repetition_penalty=0), "repetition_penalty"),
    ("greedy", dict(repetition_penalty=0), "repetition_penalty"),
    ("sample", dict(temperature=-1), "temperature"),
    ("diverse_beam", dict(num_groups=0), "num_groups"),
    ("mirostat", dict(tau=0), "tau"),
    ("sample", dict(seed=2**32), "seed"),
    ("greedy", dict(eos_ids=[1.5]), "eos_ids"),
    ("greedy", dict(temperature=0.7), "does not take"),
    # Speculative: tree specs, drafter options and widths are named with what is accepted.
    ("speculative", dict(tree="eagle:depth5"), r"'depth5' is not key=value: write settings as depth=N,topk=N"),
    ("speculative", dict(tree="eagle:depth=3,topk=2,totl=4"), "unknown setting 'totl'; this tree takes depth, topk"),
    ("speculative", dict(drafter="prompt_lookup", drafter_options={"lenghts": [2, 4]}),
     "takes no option 'lenghts'; its options: max_ngram, min_ngram, cyclic, lengths"),
    ("speculative", dict(drafter="prompt_lookup", drafter_options={"num_nodes": 4}), "node count is the tree option"),
    ("speculative", dict(drafter="prompt_lookup", tree="chain:4", verify_widths=[2, 16]),
     r"verify_widths must be node counts in 1..4"),  # under the adaptive default too
])
def test_generate_refuses_bad_option_values(model, method, opts, match):
    """No `or` defaults: 0 is a value (refused where out of range), never silently the default."""
    with pytest.raises(ValueError, match=match):
        jaxdecode.generate(model, [[5, 6]], method=method, max_new_tokens=2, **opts)


@pytest.mark.parametrize("options, match", [
    ({"catch_up": [2]}, "drafter 'draft_lm' takes no option 'catch_up'; its options: catch_up_sizes"),
    ({"catch_up_sizes": [2, 8]}, r"catch_up_sizes must be ascending block lengths in 1\.\.4"),
    ({"catch_up_sizes": "2,4"}, "catch_up_sizes must be a list of block lengths"),
    ({"catch_up_sizes": [True, 2]}, "catch_up_sizes must be a list of block lengths"),
])
def test_draft_lm_options_are_checked(model, options, match):
    """A draft model's drafter options are checked like any drafter's, never silently dropped."""
    with pytest.raises(ValueError, match=match):
        jaxdecode.generate(model, [[5, 6]], method="speculative", draft=model, tree="chain:3",
                           drafter_options=options, max_new_tokens=2)


def test_an_int_tree_is_a_chain(model):
    want = [r.tokens for r in jaxdecode.generate(model, [[5, 6], [7]], method="greedy", max_new_tokens=6)]
    out = jaxdecode.generate(model, [[5, 6], [7]], method="speculative", draft=model, tree=3, max_new_tokens=6,
                             adaptive=False)
    assert [r.tokens for r in out] == want and out[0].batch_stats["tree"] == "chain:3"
    # a lookup drafter's chain (no tree builder) is reported as the spec the tree option takes back
    out = jaxdecode.generate(model, [[5, 6], [7]], method="speculative", drafter="prompt_lookup", tree="chain:4",
                             max_new_tokens=6, adaptive=False)
    assert [r.tokens for r in out] == want and out[0].batch_stats["tree"] == "chain:4"


def test_cli_refuses_bad_option_values(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--method", "sample",
               "--top-p", "0"])
    assert rc == 2 and "top_p" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--method", "beam",
               "--option", "num_beams=0"])
    assert rc == 2 and "num_beams" in capsys.readouterr().err


def test_beams_without_a_hypothesis_are_marked(model):
    """More beams returned than hypotheses exist (2 items, 4 beams): the missing ones come back with
    finish_reason 'none' and their own per-beam stats (beam_valid False, score -inf, length 0)."""
    from jaxdecode.constraints import build_index
    ix = build_index([[100, 200], [300]], model.config.vocab_size)
    out = jaxdecode.generate(model, "x", method="constrained_beam", index=ix, num_beams=4, num_return_sequences=4,
                             max_new_tokens=4)
    assert [r.index for r in out] == [0, 1, 2, 3]
    for r in out[:2]:
        assert r.finish_reason != "none" and r.tokens and r.stats["beam_valid"] is True
        assert r.stats["beam_scores"] > float("-inf") and r.stats["beam_lengths"] == len(r.tokens)
    for r in out[2:]:
        assert (r.finish_reason, r.tokens, r.text) == ("none", [], "")
        assert r.stats["beam_valid"] is False and r.stats["beam_scores"] == float("-inf")
        assert r.stats["beam_lengths"] == 0
    # plain beam search: every beam a hypothesis, each with its own length
    out = jaxdecode.generate(model, "x", method="beam", num_beams=3, num_return_sequences=3, max_new_tokens=4)
    assert all(r.finish_reason != "none" and r.stats["beam_lengths"] == len(r.tokens) for r in out)
    one = jaxdecode.generate(model, "x", method="constrained_beam", index=ix, num_beams=4, max_new_tokens=4)[0]
    assert one.finish_reason != "none" and one.stats["beam_valid"] == [True, True, False, False]
