"""Non-finite logits (a NaN weight, an overflow) are reported per row by every decoder loop
(stats["nonfinite_logits"]) and refused by generate / the CLI, instead of decoding as token 0 with rc 0."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.api import Model, NonFiniteLogitsError
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.beam import beam_search
from jaxdecode.models import ModelConfig, param_shapes

BAD = 13  # its embedding is NaN: a row's logits are NaN from the step it feeds this token on
EOS = 63
CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, eos_token_ids=(EOS,))
PROMPTS = [[1, 2, BAD, 4], [5, 6, 7]]  # row 0 is poisoned by its prompt, row 1 is clean
N = 5


def _params(nan: bool):
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        if "scale" in jax.tree_util.keystr(path):
            return np.ones(shape, np.float32)
        return rng.normal(0.0, 0.5, shape).astype(np.float32)
    params = jax.tree_util.tree_map_with_path(leaf, param_shapes(CONFIG), is_leaf=lambda x: isinstance(x, tuple))
    if nan:
        params["embed"][BAD] = np.nan
    return jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="module")
def params():
    return {False: _params(False), True: _params(True)}


def fed(prompt, tokens, length):
    """Tokens a row fed to the model: its prompt and every new token but the last."""
    return list(prompt) + [int(t) for t in tokens[: max(int(length) - 1, 0)]]


def _index():
    from jaxdecode.constraints import build_index
    rng = np.random.default_rng(1)
    items = {tuple(int(x) for x in rng.choice([t for t in range(60) if t != BAD], 3)) for _ in range(40)}
    return build_index([list(i) for i in sorted(items)], CONFIG.vocab_size)


# Shapes and options match test_generate_refuses_nonfinite_logits's, so generate reuses these compilations.
@pytest.mark.parametrize("method, constrained", [("greedy", False), ("sample", False), ("mirostat", False),
                                                 ("greedy", True)])
def test_autoregressive_flags_rows_with_nonfinite_logits(params, method, constrained):
    from jaxdecode.sampling import SamplerConfig
    toks, lens = pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=N, eos_ids=(EOS,), key=jax.random.PRNGKey(3), method=method,
              sampler=SamplerConfig(temperature=0.0 if method == "greedy" else 1.0))
    if constrained:  # the constraint's -inf masking is not a non-finite logit
        kw["constraint"] = _index().constraint()
    clean = decode(CONFIG, params[False], toks, lens, **kw)
    assert not np.asarray(clean.stats["nonfinite_logits"]).any()
    out = decode(CONFIG, params[True], toks, lens, **kw)
    flags = np.asarray(out.stats["nonfinite_logits"])
    assert flags.shape == (2,)
    for b, p in enumerate(PROMPTS):  # exactly the rows that fed the NaN token while decoding
        assert flags[b] == (BAD in fed(p, np.asarray(out.tokens[b]), out.lengths[b])), b


@pytest.mark.parametrize("kw", [dict(num_beams=2), dict(num_beams=4, num_groups=2, diversity_penalty=0.5),
                                dict(num_beams=2, constrained=True)], ids=["beam", "diverse", "constrained"])
def test_beam_search_flags_rows_with_nonfinite_logits(params, kw):
    kw = dict(kw)
    if kw.pop("constrained", False):
        kw["constraint"] = _index().constraint()
    toks, lens = pad_prompts(PROMPTS)
    clean = beam_search(CONFIG, params[False], toks, lens, max_new_tokens=N, eos_ids=(EOS,), **kw)
    assert not np.asarray(clean.stats["nonfinite_logits"]).any()
    out = beam_search(CONFIG, params[True], toks, lens, max_new_tokens=N, eos_ids=(EOS,), **kw)
    flags = np.asarray(out.stats["nonfinite_logits"])
    assert flags.shape == (2,) and flags[0]
    if "constraint" in kw:  # no item holds the NaN token: row 1 never feeds it
        assert not flags[1]


def test_speculative_flags_rows_with_nonfinite_logits(params):
    from jaxdecode.drafters.ngram import PromptLookupDrafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier
    toks, lens = pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=N, verifier=get_verifier("greedy"), sampler=SamplerConfig(temperature=0.0),
              eos_ids=(EOS,))
    drafter = PromptLookupDrafter(num_nodes=3)
    clean = speculative_decode(CONFIG, params[False], drafter, toks, lens, **kw)
    assert not np.asarray(clean.stats["nonfinite_logits"]).any()
    out = speculative_decode(CONFIG, params[True], drafter, toks, lens, **kw)
    flags = np.asarray(out.stats["nonfinite_logits"])
    assert flags.shape == (2,) and flags[0]
    # Prompt lookup drafts from the row's own history: without the NaN token there, nothing is flagged.
    row1 = PROMPTS[1] + [int(t) for t in np.asarray(out.tokens[1])[: int(out.lengths[1])]]
    if BAD not in row1:
        assert not flags[1]


@pytest.mark.parametrize("method, opts", [("greedy", {}), ("sample", {}),
                                          ("beam", dict(num_beams=2)),
                                          ("speculative", dict(drafter="prompt_lookup", tree="chain:3"))])
def test_generate_refuses_nonfinite_logits(params, method, opts):
    model = Model(config=CONFIG, params=params[True])
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite while decoding prompt\(s\) \[0\]") as e:
        jaxdecode.generate(model, PROMPTS, method=method, max_new_tokens=N, **opts)
    assert "NaN/inf weights" in str(e.value) and "allow_nonfinite" in str(e.value)
    assert e.value.results[0].stats["nonfinite_logits"] is True
    out = jaxdecode.generate(model, PROMPTS, method=method, max_new_tokens=N, allow_nonfinite=True, **opts)
    assert out[0].stats["nonfinite_logits"] is True
    clean = jaxdecode.generate(Model(config=CONFIG, params=params[False]), PROMPTS, method=method,
                               max_new_tokens=N, **opts)
    assert [r.stats["nonfinite_logits"] for r in clean] == [False, False]


def test_cli_exits_nonzero_on_nonfinite_logits(tiny_llama_dir, tmp_path, capsys):
    from jaxdecode.cli import main
    from jaxdecode.models import save_params
    model = jaxdecode.load(tiny_llama_dir)
    broken = dict(model.params, final_norm={"scale": jnp.full_like(model.params["final_norm"]["scale"], jnp.nan)})
    save_params(model.config, broken, tmp_path)
    for f in tiny_llama_dir.iterdir():
        if "token" in f.name or f.name.endswith((".txt", ".model")):
            shutil.copy(f, tmp_path / f.name)
    args = ["generate", "--model", str(tmp_path), "--prompt", "def f(", "--max-new-tokens", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "NaN or infinite" in err and "prompt(s) [0]" in err
    assert main(args + ["--allow-nonfinite", "--json"]) == 0
    assert '"nonfinite_logits": true' in capsys.readouterr().out
