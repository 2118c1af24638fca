"""Trained drafters: the on-disk format, load_drafter's checks and the wiring to generate / the CLI
(issue 10). A test kind "unigram" (one learned logit vector, proposing chains or trees through the
shared builders) stands in for the real families."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.drafters import make_drafter, tree_from_option
from jaxdecode.drafters import trained as tr
from jaxdecode.models import ModelConfig, init_params
from jaxdecode.options import OptionError

V = 64


@dataclasses.dataclass(frozen=True)
class UnigramConfig:
    depth: int = 3
    widths: tuple = (1,)  # tuple field: must come back a tuple from JSON


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnigramDrafter:
    """Proposes from one fixed distribution softmax(logits) at every node, through any builder."""
    logits: jax.Array  # f32[V]
    builder: object = dataclasses.field(metadata=dict(static=True))

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = property(lambda self: self.builder.is_chain)

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return ()

    def propose(self, state, ctx, sampler):
        b = ctx.hist_len.shape[0]
        v = self.logits.shape[0]
        logq = jnp.broadcast_to(jax.nn.log_softmax(self.logits.astype(jnp.float32)), (b, v))

        def expand(s, start, tokens, parents_all):
            return jnp.broadcast_to(logq[:, None], tokens.shape + (v,)), s

        tree, slots, _ = self.builder.build((), logq, expand, ctx.key)
        return tree, slots, state

    def observe(self, state, obs):
        return state


def make_unigram(params, cfg, target, tree, temperature, **kw):
    if kw:
        raise ValueError(f"unigram takes no drafter options, got {sorted(kw)}")
    return UnigramDrafter(logits=params["head"]["logits"],
                          builder=tree_from_option(tree, f"chain:{cfg.depth}", temperature))


def unigram_shapes(cfg, tcfg):
    return {"head": {"logits": (tcfg.vocab_size,)}, "layers": {0: {"w": (2, 3)}}}


KIND = tr.DrafterKind(name="unigram", config_cls=UnigramConfig, make=make_unigram,
                      param_shapes=unigram_shapes)


@pytest.fixture(autouse=True, scope="module")
def unigram_kind():
    tr.register_kind(KIND, replace=True)
    yield
    tr.unregister_kind("unigram")  # keep the README's option table free of test kinds


def tiny_config(vocab=V, hidden=32, layers=2, model_type="llama"):
    return ModelConfig(model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                       max_position_embeddings=256, sliding_windows=(0,) * layers)


def tiny(seed=0, **kw):
    cfg = tiny_config(**kw)
    return jaxdecode.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(seed), std=0.3),
                           path="targets/tiny")


def unigram_params(target, seed=1):
    """Random draft logits plus a 2x3 tensor under an int key (as nnx.to_pure_dict gives lists)."""
    logits = jax.random.normal(jax.random.PRNGKey(seed), (target.config.vocab_size,))
    return {"head": {"logits": logits}, "layers": {0: {"w": jnp.arange(6.0).reshape(2, 3)}}}


@pytest.fixture(scope="module")
def target():
    return tiny()


@pytest.fixture
def saved(target, tmp_path):
    return tr.save_drafter(tmp_path / "uni", "unigram", UnigramConfig(depth=3, widths=(1, 2)),
                           unigram_params(target), target.config, extra={"tau": 1.5})


PROMPTS = [[3, 9, 27, 4, 1, 7], [8, 2, 5]]


def test_save_load_round_trip(target, saved):
    meta = json.loads((saved / "config.json").read_text())
    assert meta["jaxdecode_drafter"] == "unigram"
    assert meta["target"] == {"vocab_size": V, "hidden_size": 32, "num_layers": 2, "model_type": "llama"}
    td = jaxdecode.load_drafter(saved, target)
    assert td.kind is KIND and td.name == "unigram" and td.path == str(saved)
    assert td.cfg == UnigramConfig(depth=3, widths=(1, 2))  # tuples survive JSON
    assert td.extra == {"tau": 1.5}
    want = unigram_params(target)
    assert set(td.params) == {"head", "layers"} and list(td.params["layers"]) == [0]  # int keys stay ints
    np.testing.assert_array_equal(td.params["head"]["logits"], want["head"]["logits"])
    np.testing.assert_array_equal(td.params["layers"][0]["w"], want["layers"][0]["w"])
    assert not list(saved.parent.glob("uni.tmp-*"))  # atomic: no temporary left


def test_stored_narrow_computes_as_the_target(target, tmp_path):
    """dtype="bfloat16" halves the file; loading casts back to the target's compute dtype (f32 here)."""
    params = unigram_params(target)
    d = tr.save_drafter(tmp_path / "bf16", "unigram", UnigramConfig(depth=3, widths=(1, 2)), params,
                        target.config, dtype="bfloat16")
    meta = json.loads((d / "config.json").read_text())
    assert {t["dtype"] for t in meta["tensors"].values()} == {"bfloat16"}
    td = jaxdecode.load_drafter(d, target)
    got = td.params["head"]["logits"]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, params["head"]["logits"].astype(jnp.bfloat16).astype(jnp.float32))


def test_save_is_whole_or_nothing(target, saved):
    def bad_shapes(cfg, tcfg):
        return {"head": {"logits": (V + 1,)}, "layers": {0: {"w": (2, 3)}}}
    bad = dataclasses.replace(KIND, param_shapes=bad_shapes)
    tr.register_kind(bad, replace=True)
    try:
        with pytest.raises(tr.DrafterLoadError, match=r"'head/logits' has shape \[64\] but the config "
                                                      r"expects \[65\]"):
            tr.save_drafter(saved, "unigram", UnigramConfig(), unigram_params(target), target.config)
    finally:
        tr.register_kind(KIND, replace=True)
    assert jaxdecode.load_drafter(saved, target).extra == {"tau": 1.5}  # the old one is intact


def test_save_refuses_bad_params_and_configs(target, tmp_path):
    with pytest.raises(ValueError, match="sequence as a dict with int keys"):
        tr.save_drafter(tmp_path / "a", "unigram", UnigramConfig(), {"w": [jnp.ones(2)]}, target.config)
    with pytest.raises(ValueError, match="must be a UnigramConfig"):
        tr.save_drafter(tmp_path / "a", "unigram", {"depth": 3}, unigram_params(target), target.config)
    with pytest.raises(ValueError, match="JSON-able"):
        tr.save_drafter(tmp_path / "a", "unigram", UnigramConfig(depth=object()), unigram_params(target),
                        target.config)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("field,other", [("vocab_size", dict(vocab=96)), ("hidden_size", dict(hidden=64)),
                                         ("num_layers", dict(layers=3)), ("model_type", dict(model_type="qwen3"))])
def test_other_target_is_refused(saved, field, other):
    """Another vocabulary, width or depth; and, for a drafter that reads the target's states, another family
    of the same shape (its weights were fitted to that family's states)."""
    other_target = jaxdecode.Model(config=tiny_config(**other), params=None, path="targets/other")
    have = getattr(other_target.config, field)
    want = {"vocab_size": V, "hidden_size": 32, "num_layers": 2, "model_type": "llama"}[field]
    with pytest.raises(tr.DrafterTargetError, match=rf"drafter {saved} was trained for a target with "
                                                    rf"{field} {want}, but this target \(targets/other\) "
                                                    rf"has {have}"):
        jaxdecode.load_drafter(saved, other_target)


def test_a_record_without_the_family_still_loads(saved):
    """Drafters saved before the family was recorded load onto any target of their vocabulary, width and
    depth, as they did."""
    meta = json.loads((saved / "config.json").read_text())
    assert meta["target"].pop("model_type") == "llama"
    (saved / "config.json").write_text(json.dumps(meta))
    other = jaxdecode.Model(config=tiny_config(model_type="qwen3"), params=None, path="targets/other")
    assert jaxdecode.load_drafter(saved, other).target == meta["target"]


def _break(path, how):
    cfg, st = path / "config.json", path / "model.safetensors"
    meta = json.loads(cfg.read_text())
    if how == "no_config":
        cfg.unlink()
    elif how == "garbled_config":
        cfg.write_text("{not json")
    elif how == "no_marker":
        cfg.write_text(json.dumps({"model_type": "llama"}))
    elif how == "no_tensors":
        st.unlink()
    elif how == "truncated":
        st.write_bytes(st.read_bytes()[:-10])
    elif how == "missing_tensor":
        del meta["tensors"]["layers/0/w"]
        cfg.write_text(json.dumps(meta))
    elif how == "unknown_kind":
        meta["jaxdecode_drafter"] = "nosuchkind"
        cfg.write_text(json.dumps(meta))
    elif how == "bad_config":
        meta["config"]["nosuchfield"] = 1
        cfg.write_text(json.dumps(meta))
    elif how == "not_a_dir":
        return path / "nope"
    return path


@pytest.mark.parametrize("how,match", [
    ("no_config", r"config.json is missing"),
    ("garbled_config", r"config.json is not valid JSON"),
    ("no_marker", r"no 'jaxdecode_drafter' kind name"),
    ("no_tensors", r"model.safetensors is missing"),
    ("truncated", r"model.safetensors is truncated"),
    ("missing_tensor", r"does not match .*config.json's tensor list: missing none, not listed \['layers/0/w'\]"),
    ("unknown_kind", r"unknown trained drafter kind 'nosuchkind'; known kinds: medusa"),
    ("bad_config", r"its 'config' does not fit unigram's UnigramConfig"),
    ("not_a_dir", r"does not exist or is not a directory"),
])
def test_corrupt_directory(target, saved, how, match):
    path = _break(saved, how)
    with pytest.raises(tr.DrafterLoadError, match=match) as e:
        jaxdecode.load_drafter(path, target)
    assert str(path) in str(e.value)
    assert how in ("not_a_dir", "unknown_kind") or "retrain" in str(e.value)


def test_wrong_shape_for_the_config(target, saved):
    def shapes(cfg, tcfg):
        return {"head": {"logits": (tcfg.vocab_size,)}, "layers": {0: {"w": (3, 2)}}}
    tr.register_kind(dataclasses.replace(KIND, param_shapes=shapes), replace=True)
    try:
        with pytest.raises(tr.DrafterLoadError, match=r"'layers/0/w' has shape \[2, 3\] but the config "
                                                      r"expects \[3, 2\]"):
            jaxdecode.load_drafter(saved, target)
    finally:
        tr.register_kind(KIND, replace=True)


def test_builtin_kind_without_module(monkeypatch, saved, target):
    monkeypatch.setitem(tr.BUILTIN_KIND_MODULES, "ghost", "jaxdecode.drafters.no_such_module")
    meta = json.loads((saved / "config.json").read_text())
    meta["jaxdecode_drafter"] = "ghost"
    (saved / "config.json").write_text(json.dumps(meta))
    with pytest.raises(tr.DrafterLoadError, match="needs its decode module jaxdecode.drafters.no_such_module"):
        jaxdecode.load_drafter(saved, target)


def _greedy(target, prompts, n=12):
    return [r.tokens for r in jaxdecode.generate(target, prompts, "greedy", n)]


def test_generate_by_name_object_and_default_dir(target, saved, tmp_path):
    want = _greedy(target, PROMPTS)
    by_name = jaxdecode.generate(target, PROMPTS, "speculative", 12, drafter="unigram", drafter_dir=str(saved))
    assert [r.tokens for r in by_name] == want
    assert by_name[0].stats["verify_calls"] >= 1
    # drafter unset: the kind comes from drafter_dir's config.json; a tree option reaches the kind
    by_dir = jaxdecode.generate(target, PROMPTS, "speculative", 12, drafter_dir=saved, tree="static:2,2")
    assert [r.tokens for r in by_dir] == want
    td = jaxdecode.load_drafter(saved, target)
    assert [r.tokens for r in jaxdecode.generate(target, PROMPTS, "speculative", 12, drafter=td)] == want
    # shipped beside the target: <target_dir>/drafters/<kind>
    tdir = tmp_path / "target"
    (tdir / "drafters").mkdir(parents=True)
    saved.rename(tdir / "drafters" / "unigram")
    shipped = dataclasses.replace(target, path=str(tdir))
    assert [r.tokens for r in jaxdecode.generate(shipped, PROMPTS, "spec", 12, drafter="unigram")] == want


def test_a_replaced_kind_builds_anew(target, saved):
    # make_drafter remembers built drafters; a kind registered anew under the name must build with its
    # own make, not hand back what the old one built.
    first = make_drafter("unigram", target, drafter_dir=saved)
    assert make_drafter("unigram", target, drafter_dir=saved) is first  # remembered
    calls = []

    def counting(*a, **kw):
        calls.append(1)
        return make_unigram(*a, **kw)
    tr.register_kind(dataclasses.replace(KIND, make=counting), replace=True)
    try:
        assert make_drafter("unigram", target, drafter_dir=saved) is not first and calls == [1]
    finally:
        tr.register_kind(KIND, replace=True)


def test_wiring_errors(target, saved, tmp_path):
    with pytest.raises(ValueError, match="--drafter-dir DIR"):
        jaxdecode.generate(target, PROMPTS, "speculative", 4, drafter="unigram")
    with pytest.raises(ValueError, match=r"--drafter-dir DIR.*none is shipped with the target"):
        make_drafter("unigram", dataclasses.replace(target, path=str(tmp_path)))
    with pytest.raises(OptionError, match="drafter_dir is for trained drafters"):
        jaxdecode.generate(target, PROMPTS, "speculative", 4, drafter="prompt_lookup", drafter_dir=str(saved))
    with pytest.raises(ValueError, match="already loaded"):
        make_drafter(jaxdecode.load_drafter(saved, target), target, drafter_dir=str(saved))
    with pytest.raises(ValueError, match=r"holds a 'unigram' drafter, but drafter='medusa'"):
        make_drafter("medusa", target, drafter_dir=str(saved))
    with pytest.raises(tr.DrafterTargetError, match="hidden_size 32, but"):
        make_drafter(jaxdecode.load_drafter(saved, target), tiny_config(hidden=64))
    with pytest.raises(OptionError, match="drafter='nope'"):
        jaxdecode.generate(target, PROMPTS, "speculative", 4, drafter="nope")


def test_check_options_names_what_a_make_takes():
    """A kind's make with named options: an unknown one is refused with them, whatever its positional
    parameters are called; a make with **kwargs checks its own."""
    def make(p, c, tg, tr_, temp, *, alpha=1, beta=None):
        return None
    tr.check_options("mine", make, {"alpha": 2}, positional=5)
    with pytest.raises(ValueError, match="drafter 'mine' takes no option 'c', 'gamma'; its options: alpha, beta"):
        tr.check_options("mine", make, {"gamma": 1, "c": 0}, positional=5)
    with pytest.raises(ValueError, match="takes no option 'x'; its options: none"):
        tr.check_options("bare", lambda p, c, tg, tr_, temp: None, {"x": 1}, positional=5)
    tr.check_options("open", lambda *a, **kw: None, {"anything": 1}, positional=5)


def test_cli_drafter_dir(tiny_llama_dir, tmp_path, capsys):
    from jaxdecode.cli import main
    model = jaxdecode.load(tiny_llama_dir)
    d = tr.save_drafter(tmp_path / "uni", "unigram", UnigramConfig(depth=2), unigram_params(model),
                        model.config)
    base = ["generate", "--model", str(tiny_llama_dir), "--prompt", "def add(", "--prompt", "class",
            "--max-new-tokens", "6", "--json"]
    assert main(base + ["--method", "greedy"]) == 0
    want = [json.loads(x)["tokens"] for x in capsys.readouterr().out.strip().splitlines()[:-1]]
    assert main(base + ["--method", "spec", "--drafter", "unigram", "--drafter-dir", str(d)]) == 0
    got = [json.loads(x)["tokens"] for x in capsys.readouterr().out.strip().splitlines()[:-1]]
    assert got == want


def test_draft_model_reaches_kinds_that_take_one(target, saved):
    seen = []

    def make_over_lm(params, cfg, target, tree, temperature, draft_model=None):
        seen.append(draft_model)
        return make_unigram(params, cfg, target, tree, temperature)

    with pytest.raises(ValueError, match="the unigram drafter does not draft with a draft model: drop draft"):
        jaxdecode.generate(target, PROMPTS, "speculative", 4, drafter="unigram", drafter_dir=saved, draft=target)
    tr.register_kind(dataclasses.replace(KIND, make=make_over_lm), replace=True)
    try:
        out = jaxdecode.generate(target, PROMPTS, "speculative", 12, drafter_dir=saved, draft=target)
        assert [r.tokens for r in out] == _greedy(target, PROMPTS) and seen == [target]
        with pytest.raises(ValueError, match="given twice"):
            make_drafter("unigram", target, draft=target, drafter_dir=saved, draft_model=target)
    finally:
        tr.register_kind(KIND, replace=True)
    with pytest.raises(OptionError, match="draft is used only by drafter 'draft_lm'"):
        jaxdecode.generate(target, PROMPTS, "speculative", 4, drafter="prompt_lookup", draft=target)


def test_built_inside_a_callers_jit(target, tmp_path):
    # make_drafter remembers what it loads and builds; called inside a user's jit with concrete weights,
    # it must keep concrete arrays (the bf16 file is cast on load), or the next trace reads the first
    # one's tracers. Built from traced weights, nothing is kept.
    from jaxdecode.autoregressive import pad_prompts
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier
    d = tr.save_drafter(tmp_path / "bf16", "unigram", UnigramConfig(depth=3), unigram_params(target),
                        target.config, dtype="bfloat16")
    fresh = dataclasses.replace(target, params=jax.tree.map(lambda a: a + 0, target.params))  # nothing remembered
    toks, lens = pad_prompts(PROMPTS)

    def run(params, n):
        model = fresh if params is fresh.params else dataclasses.replace(fresh, params=params)  # one key
        return speculative_decode(target.config, params, make_drafter("unigram", model, drafter_dir=d), toks, lens,
                                  max_new_tokens=n, verifier=get_verifier("greedy")).tokens
    outs = [jax.jit(lambda n=n: run(fresh.params, n))() for n in (10, 12)]
    traced = jax.jit(lambda p: run(p, 12))(fresh.params)  # the target's weights passed in: traced
    want = [r.tokens for r in jaxdecode.generate(fresh, PROMPTS, "greedy", 12)]
    for out in (outs[1], traced, run(fresh.params, 12)):
        assert [list(map(int, row[:len(w)])) for row, w in zip(np.asarray(out), want)] == want
    assert [list(map(int, row[:10])) for row in np.asarray(outs[0])] == [w[:10] for w in want]
