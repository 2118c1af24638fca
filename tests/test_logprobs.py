"""Per-token log-probs (logprobs / top_logprobs), prompt scoring (echo, jaxdecode.scoring) and per-row
speculative statistics, against transformers (PyTorch, float32) on a tiny random Llama checkpoint.

transformers' reference for a token's log-prob is log_softmax of the processed scores at its step
(generate(output_scores=True) + compute_transition_scores(normalize_logits=True)); the scores are
recomputed here by one teacher-forced forward over prompt + output, with transformers' own logits
processors (repetition penalty, temperature, top-k)."""
import jax
import numpy as np
import pytest

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import DraftLM, make_drafter, parse_tree_spec
from jaxdecode.models import forward, padded_causal_mask
from jaxdecode.sampling import SamplerConfig, process_logits
from jaxdecode.scoring import prompt_logprobs, score
from jaxdecode.speculative import speculative_decode
from jaxdecode.verifiers import default_verifier, get_verifier

PROMPTS = [[5, 17, 101, 33, 8, 250, 12], [40, 2, 77]]  # ragged: right-padded into one batch
N = 10
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype="float32").eval()
    return jaxdecode.load(tiny_llama_dir), hf


def hf_logits(hf, ids) -> np.ndarray:
    """f32[T, V]: transformers' logits over one unpadded sequence."""
    import torch
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def step_logits(hf, prompt, new):
    """transformers' logits [len(new), V] at the steps that produced `new` (teacher forced)."""
    seq = list(prompt) + list(new)
    return hf_logits(hf, seq)[len(prompt) - 1:len(seq) - 1], seq


def hf_processed(logits_row, seen, *, temperature=None, top_k=None, repetition_penalty=None):
    """log_softmax of one step's scores after transformers' processors, in generate's order."""
    import torch
    import transformers as tf
    ids = torch.tensor([seen])
    scores = torch.tensor(logits_row[None])
    procs = []
    if repetition_penalty:
        procs.append(tf.RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature:
        procs.append(tf.TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(tf.TopKLogitsWarper(top_k))
    for p in procs:
        scores = p(ids, scores)
    return torch.log_softmax(scores, dim=-1)[0].numpy()


def check_against_hf(hf, out, top_n, **proc):
    """Every emitted token's log-prob and the top-n (ids and values) equal transformers'."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    lp, top, ids = (np.asarray(out.stats[k]) for k in ("logprobs", "top_logprobs", "top_logprob_ids"))
    for b, prompt in enumerate(PROMPTS):
        new = tokens[b, :lengths[b]]
        logits, seq = step_logits(hf, prompt, new)
        for t, tok in enumerate(new):
            ref = hf_processed(logits[t], seq[:len(prompt) + t], **proc)
            np.testing.assert_allclose(lp[b, t], ref[tok], atol=ATOL, err_msg=f"row {b} step {t}")
            best = np.argsort(-ref, kind="stable")[:top_n]
            finite = np.isfinite(ref[best])
            np.testing.assert_allclose(top[b, t][finite], ref[best][finite], atol=ATOL)
            np.testing.assert_array_equal(ids[b, t][finite], best[finite])
            assert np.all(ids[b, t][~finite] == -1) and np.all(np.isneginf(top[b, t][~finite]))


def test_greedy_logprobs_and_top_n_equal_transformers(pair):
    model, hf = pair
    toks, lens = pad_prompts(PROMPTS)
    out = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="greedy", logprobs=True,
                 top_logprobs=4)
    assert np.asarray(out.stats["top_logprobs"]).shape == (2, N, 4)
    check_against_hf(hf, out, 4)
    # Greedy emits the top alternative.
    np.testing.assert_array_equal(np.asarray(out.stats["top_logprob_ids"])[..., 0], np.asarray(out.tokens))


def test_greedy_repetition_penalty_logprobs_equal_transformers(pair):
    model, hf = pair
    toks, lens = pad_prompts(PROMPTS)
    out = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="greedy", logprobs=True,
                 top_logprobs=2, sampler=SamplerConfig(temperature=0.0, repetition_penalty=1.5))
    check_against_hf(hf, out, 2, repetition_penalty=1.5)


def test_sample_logprobs_are_the_processed_distributions(pair):
    """temperature + top-k: the log-prob under the truncated, renormalised distribution; top-n past the
    k kept tokens are -inf with id -1."""
    model, hf = pair
    toks, lens = pad_prompts(PROMPTS)
    out = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="sample", logprobs=True,
                 top_logprobs=6, sampler=SamplerConfig(temperature=0.7, top_k=4), key=jax.random.PRNGKey(3))
    check_against_hf(hf, out, 6, temperature=0.7, top_k=4)
    ids = np.asarray(out.stats["top_logprob_ids"])
    assert np.all(ids[..., 4:] == -1) and np.all(ids[..., :4] >= 0)


def test_mirostat_reports_its_truncated_distribution(pair):
    """Mirostat draws from the sampler's distribution truncated at surprise mu and renormalised: each
    token's log-prob is at least its untruncated one, and its top-1 is the untruncated top-1."""
    model, hf = pair
    toks, lens = pad_prompts(PROMPTS)
    out = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="mirostat", logprobs=True,
                 top_logprobs=1, sampler=SamplerConfig(temperature=1.0), key=jax.random.PRNGKey(0),
                 mirostat_tau=2.0)
    tokens, lp = np.asarray(out.tokens), np.asarray(out.stats["logprobs"])
    for b, prompt in enumerate(PROMPTS):
        logits, _ = step_logits(hf, prompt, tokens[b])
        full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        assert np.all(lp[b] >= full[np.arange(N), tokens[b]] - ATOL) and np.all(lp[b] <= 0)
        np.testing.assert_array_equal(np.asarray(out.stats["top_logprob_ids"])[b, :, 0], full.argmax(-1))


def test_finished_rows_are_padded(pair):
    """After a row's EOS: log-prob 0 (a row sums to its sequence log-prob), top -inf, ids -1."""
    model, _ = pair
    toks, lens = pad_prompts(PROMPTS)
    ref = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="greedy", logprobs=True)
    eos = int(np.asarray(ref.tokens)[0, 2])
    assert eos not in np.asarray(ref.tokens)[1]
    out = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="greedy", eos_ids=(eos,),
                 top_logprobs=3)  # top_logprobs alone implies logprobs
    assert np.asarray(out.lengths).tolist() == [3, N]
    lp = np.asarray(out.stats["logprobs"])
    np.testing.assert_allclose(lp[0, :3], np.asarray(ref.stats["logprobs"])[0, :3], atol=1e-6)
    assert np.all(lp[0, 3:] == 0) and np.all(np.isneginf(np.asarray(out.stats["top_logprobs"])[0, 3:]))
    assert np.all(np.asarray(out.stats["top_logprob_ids"])[0, 3:] == -1)
    assert "logprobs" not in decode(model.config, model.params, toks, lens, max_new_tokens=2,
                                    method="greedy").stats  # nothing unless asked
    with pytest.raises(ValueError, match="top_logprobs must be an int in 0..20"):
        decode(model.config, model.params, toks, lens, max_new_tokens=2, method="greedy", top_logprobs=21)


# ----------------------------------------------------------------------------- speculative
def _spec(model, drafter, sampler, key=None, **kw):
    toks, lens = pad_prompts(PROMPTS)
    return speculative_decode(model.config, model.params, drafter, toks, lens, max_new_tokens=N, sampler=sampler,
                              verifier=get_verifier(default_verifier(drafter, sampler)), key=key, logprobs=True,
                              top_logprobs=3, **kw)


def test_greedy_speculative_logprobs_are_the_targets(pair):
    """Equal to plain greedy decoding's (the target's) with prompt lookup (bonus tokens after
    rejections and accepted nodes both occur); draft LMs and trees: the tests below."""
    model, _ = pair
    greedy = SamplerConfig(temperature=0.0)
    toks, lens = pad_prompts(PROMPTS)
    ref = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="greedy", logprobs=True,
                 top_logprobs=3)
    drafter = make_drafter("prompt_lookup", model, tree="chain:4")
    out = _spec(model, drafter, greedy)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    for k in ("logprobs", "top_logprobs"):
        np.testing.assert_allclose(np.asarray(out.stats[k]), np.asarray(ref.stats[k]), atol=1e-5, err_msg=k)
    np.testing.assert_array_equal(np.asarray(out.stats["top_logprob_ids"]), np.asarray(ref.stats["top_logprob_ids"]))
    hist, calls = np.asarray(out.stats["accept_hist"]), np.asarray(out.stats["verify_calls"])
    assert hist.shape == (2, drafter.max_depth + 1)
    np.testing.assert_array_equal(hist.sum(1), calls)  # per row: one entry per verification it took part in


def test_sampling_speculative_logprobs_are_the_processed_target(pair):
    """At T = 0.7 with top-k: the reported log-probs are the target's processed distribution at each
    committed token (recomputed by a teacher-forced transformers forward), not the drafter's."""
    model, hf = pair
    sampler = SamplerConfig(temperature=0.7, top_k=8)
    noisy = jax.tree.map(lambda p: p * 0.9, model.params)  # a different draft distribution
    drafter = DraftLM(params=noisy, config=model.config, builder=parse_tree_spec("chain:3"))
    out = _spec(model, drafter, sampler, key=jax.random.PRNGKey(5))
    assert float(np.mean(np.asarray(out.stats["tau"]))) > 1  # drafts were accepted
    check_against_hf(hf, out, 3, temperature=0.7, top_k=8)


def test_adaptive_speculative_through_generate(tiny_llama_dir):
    """The adaptive engine (compacted trees, plain steps) reports the same log-probs as greedy, through the
    method adapters; accept_hist and the adaptive counters come per row."""
    from jaxdecode.options import resolve
    from jaxdecode.registry import get_method
    model = jaxdecode.load(tiny_llama_dir)
    toks, lens = pad_prompts(PROMPTS)
    runs = {}
    for method, extra in (("greedy", {}), ("speculative", dict(draft=model, tree="static:2,2"))):
        opts = resolve(method, dict(extra, logprobs=True, top_logprobs=4, max_new_tokens=N), batch=2)
        opts.pop("max_new_tokens"), opts.pop("allow_nonfinite")
        opts["eos_ids"] = ()
        runs[method] = get_method(method).run(model, toks, lens, N, opts)
    (gt, _, gs), (st, _, ss) = runs["greedy"], runs["speculative"]
    np.testing.assert_array_equal(np.asarray(st), np.asarray(gt))
    np.testing.assert_allclose(np.asarray(ss["logprobs"]), np.asarray(gs["logprobs"]), atol=1e-5)
    spec = get_method("speculative")
    for k in ("accept_hist", "drafted_nodes", "speculative_steps", "tau", "verify_calls"):
        assert k in spec.per_row_stats and np.shape(ss[k])[0] == 2, k


# ----------------------------------------------------------------------------- scoring
def test_prompt_logprobs_equal_transformers(pair):
    model, hf = pair
    lists = PROMPTS + [[9]]
    got = prompt_logprobs(model, lists)
    for ids, lps in zip(lists, got):
        assert len(lps) == len(ids) and lps[0] is None
        ref = np.asarray(jax.nn.log_softmax(hf_logits(hf, ids), axis=-1))
        np.testing.assert_allclose(lps[1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=ATOL)
    s = score(model, PROMPTS[0])[0]
    assert s.tokens == PROMPTS[0] and s.logprobs[0] is None
    np.testing.assert_allclose(s.logprobs[1:], got[0][1:], atol=1e-5)  # batch 1 vs 3: float rounding
    assert s.total == pytest.approx(sum(s.logprobs[1:]), abs=1e-5)
    texts = score(model, ["def add(a, b):", "import os"])
    assert [t.tokens for t in texts] == [model.encode("def add(a, b):"), model.encode("import os")]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prompt_logprobs(model, [[1, 2, 10**6]])
    with pytest.raises(ValueError, match="non-empty"):
        prompt_logprobs(model, [[]])


def test_sample_logprobs_match_jaxdecode_sampler(pair):
    """The recorded distribution is process_logits' own (top-p and min-p as well), not just HF's subset."""
    model, _ = pair
    sampler = SamplerConfig(temperature=0.9, top_p=0.8, min_p=0.05)
    toks, lens = pad_prompts(PROMPTS)
    out = decode(model.config, model.params, toks, lens, max_new_tokens=N, method="sample", logprobs=True,
                 sampler=sampler, key=jax.random.PRNGKey(1))
    tokens, lp = np.asarray(out.tokens), np.asarray(out.stats["logprobs"])
    seq, seq_lens = pad_prompts([list(p) + tokens[b].tolist() for b, p in enumerate(PROMPTS)])
    valid = np.arange(seq.shape[1])[None, :] < seq_lens[:, None]
    logits, _, _ = forward(model.config, model.params, seq, np.broadcast_to(np.arange(seq.shape[1]), seq.shape),
                           None, padded_causal_mask(valid))  # teacher forced, one padded forward
    for b, prompt in enumerate(PROMPTS):
        dist = np.asarray(process_logits(logits[b, len(prompt) - 1:len(prompt) - 1 + N], sampler))
        np.testing.assert_allclose(lp[b], dist[np.arange(N), tokens[b]], atol=ATOL)


def test_generate_logprobs_and_echo_equal_transformers(pair):
    """generate(logprobs=True, top_logprobs=n, echo=True): Generation.logprobs / top_logprobs /
    prompt_logprobs equal transformers' log_softmax on the generated and the prompt tokens."""
    model, hf = pair
    out = jaxdecode.generate(model, PROMPTS, method="greedy", max_new_tokens=N, eos_ids=[], logprobs=True,
                             top_logprobs=4, echo=True)
    for prompt, g in zip(PROMPTS, out):
        seq = prompt + g.tokens
        ref = np.asarray(jax.nn.log_softmax(hf_logits(hf, seq), axis=-1))  # [T, V]: row t predicts t + 1
        got = np.array([ref[t, seq[t + 1]] for t in range(len(seq) - 1)])
        np.testing.assert_allclose(g.logprobs, got[len(prompt) - 1:], atol=ATOL)
        assert g.prompt_logprobs[0] is None
        np.testing.assert_allclose(g.prompt_logprobs[1:], got[:len(prompt) - 1], atol=ATOL)
        best = np.argsort(-ref[len(prompt) - 1:-1], axis=-1, kind="stable")[:, :4]
        assert [[i for i, _ in step] for step in g.top_logprobs] == best.tolist()
        assert "logprobs" not in g.stats and "top_logprob_ids" not in g.batch_stats


def test_constrained_logprobs_are_masked_and_speculative_reports_the_same(pair):
    """Under regex=: the distribution is the masked, renormalised one (each token's log-prob at least the
    unconstrained one, every listed alternative allowed), and speculative decoding reports exactly
    what constrained greedy does."""
    model, hf = pair
    kw = dict(max_new_tokens=8, eos_ids=[0], regex="[a-z]+( [a-z]+)*", logprobs=True, top_logprobs=3)
    plain = jaxdecode.generate(model, PROMPTS, method="greedy", **kw)
    spec = jaxdecode.generate(model, PROMPTS, method="speculative", drafter="prompt_lookup", tree="chain:3",
                              adaptive=False, **kw)
    for prompt, g, s in zip(PROMPTS, plain, spec):
        assert s.tokens == g.tokens
        np.testing.assert_allclose(s.logprobs, g.logprobs, atol=1e-5)
        assert [[i for i, _ in t] for t in s.top_logprobs] == [[i for i, _ in t] for t in g.top_logprobs]
        logits, _ = step_logits(hf, prompt, g.tokens)
        full = np.asarray(jax.nn.log_softmax(logits, axis=-1))[np.arange(len(g.tokens)), g.tokens]
        assert np.all(np.asarray(g.logprobs) >= full - ATOL) and np.any(np.asarray(g.logprobs) > full + 0.1)
        for step in g.top_logprobs:  # alternatives: letters or a space (or EOS), never anything else
            assert all(i == 0 or all(c.isalpha() or c == " " for c in model.decode([i])) for i, _ in step)


def test_embedded_draft_lm_reports_the_targets_logprobs():
    """The embedded target with its embedded draft LM (a real, different model) on a branching tree:
    greedy speculative log-probs equal plain greedy decoding's, i.e. the target's."""
    target, draft = jaxdecode.load(), jaxdecode.load("draft")
    ids = [target.encode("def add(a, b):\n", add_special_tokens=False), target.encode("import os\n")]
    toks, lens = pad_prompts(ids)
    ref = decode(target.config, target.params, toks, lens, max_new_tokens=12, method="greedy", top_logprobs=2)
    drafter = make_drafter("draft_lm", target, draft=draft, tree="static:2,2")
    out = speculative_decode(target.config, target.params, drafter, toks, lens, max_new_tokens=12,
                             verifier=get_verifier("greedy"), top_logprobs=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert np.asarray(out.stats["accept_hist"])[:, 1:].sum() > 0  # the draft's tokens were accepted
    for k in ("logprobs", "top_logprobs"):
        np.testing.assert_allclose(np.asarray(out.stats[k]), np.asarray(ref.stats[k]), atol=1e-5, err_msg=k)
