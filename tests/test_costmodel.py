"""The cost model (jaxdecode.costmodel): tables, measuring, the on-disk cache and `jaxdecode calibrate`.

Cache tests replace `measure` by a counting fake, so a hit is "the fake was not called"; one test
measures for real on a tiny model (a few compiles)."""
import functools
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.real_costs  # the real measurement and cache, not the synthetic table

from jaxdecode import costmodel
from jaxdecode.costmodel import CostTable, CostTableError
from jaxdecode.drafters import DraftLM, parse_tree_spec
from jaxdecode.drafters.ngram import PromptLookupDrafter
from jaxdecode.models import ModelConfig, param_shapes

V = 64


@functools.lru_cache(maxsize=None)
def tiny(seed=0, layers=2):
    """A tiny random model; weights drawn with numpy (init_params' compile costs seconds)."""
    cfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda shape: jnp.asarray(rng.normal(0, 0.3, shape), jnp.float32), param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    return cfg, params


def table(widths=(0, 1, 2, 4), batch_size=1, **kw):
    return CostTable(widths=widths, verify_seconds=tuple(1e-3 * (1 + w) for w in widths),
                     draft_seconds=kw.get("draft", 5e-4), idle_seconds=kw.get("idle", 0.0),
                     batch_size=batch_size, meta=kw.get("meta", {"note": "test"}),
                     step_seconds=tuple(1e-3 * (2 + w) for w in widths) if kw.get("steps") else ())


# ----------------------------------------------------------------------------- the table
def test_table_round_trip_and_interpolation():
    t = table(meta={"device": {"platform": "cpu"}, "context_len": 64})
    again = CostTable.from_json(json.loads(json.dumps(t.to_json())))
    assert again == t and again.meta == t.meta and hash(again) == hash(t)
    assert CostTable.from_json(json.dumps(t.to_json())) == t  # from the JSON text too
    assert t.verify_at(2) == pytest.approx(3e-3)
    assert t.verify_at(3) == pytest.approx(4e-3)  # between 2 and 4
    assert t.verify_at(0.5) == pytest.approx(1.5e-3)
    assert t.verify_at(8) == pytest.approx(9e-3)  # past the last width: the last slope continues
    assert t.plain_seconds == pytest.approx(1e-3)
    with pytest.raises(CostTableError, match="width must be a number >= 0"):
        t.verify_at(-1)


def test_a_step_is_priced_by_the_whole_engine_step():
    """step_at: the measured engine step less the drafter's part (propose when drafting, idle on a
    plain step), never below the forward; without step_seconds, the forward; the policy's costs use it
    and keep a wider step from costing less than a narrower one."""
    from jaxdecode.adaptive import AdaptivePolicy, cost_vector
    t = dataclasses.replace(table(draft=5e-4, idle=2e-4), step_seconds=(3e-3, 5e-3, 4e-3, 9e-3))
    assert t.step_at(0) == pytest.approx(3e-3 - 2e-4) and t.plain_seconds == pytest.approx(2.8e-3)
    assert t.step_at(1) == pytest.approx(5e-3 - 5e-4)
    assert t.step_at(2) == pytest.approx(max(4e-3 - 5e-4, t.verify_at(2)))
    assert CostTable.from_json(t.to_json()) == t
    vec = cost_vector(AdaptivePolicy(widths=(0, 1, 2, 4)), t).tolist()
    # steps per width, then the draft per width (a drafter that drafts its whole proposal: the same), idle
    # (width 2 measured cheaper than width 1: the least-squares monotone fit pools them at their mean)
    assert vec[:4] == pytest.approx([2.8e-3, 4.0e-3, 4.0e-3, 8.5e-3])
    assert vec[4:] == pytest.approx([5e-4] * 4 + [2e-4, 0.0])  # draft per width, idle, catch-up
    assert table().step_at(2) == table().verify_at(2)  # nothing measured but the forward


def test_a_plain_token_is_priced_as_the_lean_run_measured_it():
    """Width 0 is a lean run's token, timed as the engine runs it, forward included: no floor at the
    forward timed alone. Two noisy timings' maximum priced plain decoding high: a table whose forward
    alone measured 3.31 ms against a 2.85 ms lean token made Medusa's 4-node step look worth drafting
    (1.9 plain tokens), and the policy drafted it 40 times in 512 sampled tokens, where the 2.85 ms
    price drafts 11 times (0.90-0.92x plain decoding -> 0.89-0.96x, median 0.945x; 3 runs each)."""
    t = dataclasses.replace(table(draft=5e-4, idle=2e-4), verify_seconds=(3.3e-3, 4e-3, 5e-3, 6e-3),
                            step_seconds=(2.9e-3, 5e-3, 6e-3, 9e-3))
    assert t.step_at(0) == pytest.approx(2.9e-3 - 2e-4)  # not the forward's 3.3 ms
    assert t.step_at(1) == pytest.approx(max(5e-3 - 5e-4, 4e-3))  # drafting widths keep the floor
    assert dataclasses.replace(t, step_seconds=()).step_at(0) == pytest.approx(3.3e-3)  # the forward alone


def test_old_tables_read_without_step_seconds():
    """A table written before whole steps were timed reads as one priced by the forward alone."""
    old = {k: v for k, v in table().to_json().items() if k != "step_seconds"}  # a table from before
    assert CostTable.from_json(old) == table()


def test_a_level_capped_draft_is_priced_at_the_levels_it_drafts():
    """draft_by_width (a level_capped drafter's propose capped at each width): draft_at interpolates it,
    step_at subtracts the draft the forced step paid at that width, the policy's costs carry one draft
    per width (made non-decreasing); a table without it prices every width at the whole proposal."""
    from jaxdecode.adaptive import AdaptivePolicy, cost_vector
    t = dataclasses.replace(table(draft=8e-4), step_seconds=(3e-3, 5e-3, 6e-3, 9e-3),
                            draft_by_width=(0.0, 2e-4, 4e-4, 8e-4))
    assert t.draft_at(1) == pytest.approx(2e-4) and t.draft_at(3) == pytest.approx(6e-4)
    assert t.step_at(1) == pytest.approx(5e-3 - 2e-4) and t.step_at(4) == pytest.approx(9e-3 - 8e-4)
    assert CostTable.from_json(json.loads(json.dumps(t.to_json()))) == t
    vec = cost_vector(AdaptivePolicy(widths=(0, 1, 2, 4)), t).tolist()
    assert vec[4:] == pytest.approx([8e-4, 2e-4, 4e-4, 8e-4, 0.0, 0.0])  # whole proposal, per width, idle, catch-up
    noisy = dataclasses.replace(t, draft_by_width=(0.0, 3e-4, 2e-4, 8e-4))  # a deeper draft measured cheaper
    assert cost_vector(AdaptivePolicy(widths=(0, 1, 2, 4)), noisy).tolist()[5:7] == pytest.approx([2.5e-4, 2.5e-4])
    assert table(draft=8e-4).draft_at(1) == pytest.approx(8e-4)
    with pytest.raises(CostTableError, match="draft_by_width must be"):
        dataclasses.replace(t, draft_by_width=(0.0, 1e-4))


@pytest.mark.parametrize("bad, match", [
    (dict(widths=(1, 2)), "start at 0"),
    (dict(widths=(0, 2, 1)), "ascending"),
    (dict(verify_seconds=(1e-3,)), "one entry per width"),
    (dict(verify_seconds=(1e-3, -1.0, 1e-3, 1e-3)), "finite numbers >= 0"),
    (dict(draft_seconds=math.nan), "finite numbers >= 0"),
    (dict(batch_size=0), "batch_size"),
])
def test_bad_tables_are_refused(bad, match):
    fields = dict(table().to_json(), **bad)
    for name in ("widths", "verify_seconds", "step_seconds", "draft_by_width"):
        fields[name] = tuple(fields[name])
    with pytest.raises(CostTableError, match=match):
        CostTable(**fields)


def test_default_widths():
    assert costmodel.default_widths(8) == (0, 1, 2, 4, 8)
    assert costmodel.default_widths(6) == (0, 1, 2, 4, 6)
    assert costmodel.default_widths(1) == (0, 1)
    assert costmodel.check_widths([4, 1], 4) == (0, 1, 4)
    with pytest.raises(ValueError, match=r"widths \[16\] exceed the drafter's tree \(4 nodes\)"):
        costmodel.check_widths([1, 16], 4)  # a whole step cannot verify more than the tree holds
    assert costmodel.check_widths([1, 16], 4, stepped=False) == (0, 1, 16)  # the forward alone can
    with pytest.raises(ValueError, match="repeat"):
        costmodel.check_widths([1, 1], 4)
    with pytest.raises(ValueError, match="ints >= 0"):
        costmodel.check_widths([-1], 4)


# ----------------------------------------------------------------------------- measuring
def test_measure_times_every_item(tmp_path, monkeypatch):
    """Measured for real (through load_or_calibrate, which shows progress), then read from the cache."""
    lines = []
    real = costmodel.measure
    monkeypatch.setattr(costmodel, "measure", lambda *a, **kw: real(*a, **dict(kw, repeats=1, target_seconds=0.0)))
    cfg, params = tiny(layers=1)
    dcfg, dparams = tiny(1, layers=1)
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("chain:2"))
    t = costmodel.load_or_calibrate((cfg, params), drafter, 2, widths=(0, 2), context_len=8, cache_dir=tmp_path,
                                    progress=lines.append)
    assert t.widths == (0, 2) and t.batch_size == 2 and len(t.verify_seconds) == len(t.step_seconds) == 2
    assert min(t.verify_seconds) > 0 and t.draft_seconds > 0
    assert t.idle_seconds == 0.0  # DraftLM has no idle step: it catches up on skipped tokens when it drafts
    assert t.meta["context_len"] == 8 and t.meta["drafter"] == "DraftLM" and t.meta["verifier"] == "greedy"
    assert lines[0].startswith("calibrate: measuring") and str(tmp_path) in lines[0]
    kinds = [line.split()[1] for line in lines[1:]]
    # a chain draft LM is level_capped: its propose is also timed capped at each drafting width
    assert kinds == ["verify", "verify", "draft", "draft", "catch-up", "step", "step"], lines
    # A draft LM catches up on what was committed since it last drafted: measured (the progress line
    # above), but on a 1-layer toy timed once its 32 extra tokens can vanish in the noise, and the
    # difference is floored at 0 (test_catch_up_is_the_far_loops_excess_per_extra_token: the arithmetic).
    assert t.catch_up_seconds >= 0
    assert len(t.draft_by_width) == 2 and t.draft_by_width[0] == 0.0 and t.draft_by_width[1] > 0
    lines.clear()
    again = costmodel.load_or_calibrate((cfg, params), drafter, 2, widths=(0, 2), context_len=8,
                                        cache_dir=tmp_path, progress=lines.append)
    assert again == t and lines == []  # a hit measures nothing and says nothing


def test_each_item_is_the_least_of_its_timed_loops():
    """A busy machine only adds time: a loop slowed in one round keeps its undisturbed figure, and the
    loops run round robin (one round of every loop, then the next)."""
    order = []

    class Scripted:
        def __init__(self, name, seconds):
            self.name, self.seconds, self.trips, self.times = name, list(seconds), 1, []

        def __call__(self, state, trips):
            order.append(self.name)
            return state, self.seconds.pop(0)

    # per loop: the compile + warm-up call, the first timing (sizes the trips), then 3 rounds
    loops = [Scripted("a", [9.0, 1.0, 1.0, 5.0, 1.2]), Scripted("b", [9.0, 2.0, 2.1, 2.0, 7.0])]
    assert costmodel._time_loops(loops, None, repeats=3, target_seconds=0.0) == [1.0, 2.0]
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3


@pytest.mark.parametrize("near,far,want", [(2e-3, 2e-3 + 32 * 5e-5, 5e-5), (3e-3, 2e-3, 0.0)])
def test_catch_up_is_the_far_loops_excess_per_extra_token(monkeypatch, near, far, want):
    """The catch-up price is the far loop's excess over the steady one per extra token (CATCH_UP_SPAN
    of them), floored at 0 when noise makes the far loop the faster; the two loops move the history
    by a steady step (max_depth + 1) and by CATCH_UP_SPAN more, and share one compile."""
    seen = []

    def fake(loops, state, *a, **kw):
        seen.append([int(loop.args[-1]) for loop in loops] + [loops[1].same_as is loops[0]])
        return [near, far]

    monkeypatch.setattr(costmodel, "_time_loops", fake)
    dcfg, dparams = tiny(1, layers=1)
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("chain:2"))
    prompt = jnp.zeros((1, 8), jnp.int32)
    got = costmodel._measure_catch_up(drafter, prompt, jnp.full((1,), 8, jnp.int32), None, 16, None,
                                      jax.random.PRNGKey(0), jax.random.PRNGKey(1), dcfg.vocab_size, 1, 0.0)
    assert got == pytest.approx(want)
    steady = drafter.max_depth + 1
    assert seen == [[steady, steady + costmodel.CATCH_UP_SPAN, True]]


def test_idle_only_when_the_drafter_has_one(monkeypatch):
    timed = []

    def fake(loops, state, *a, **kw):
        timed.append(len(loops))
        return [1e-3] * len(loops)

    monkeypatch.setattr(costmodel, "_time_loops", fake)
    t = costmodel.measure(tiny(layers=1), PromptLookupDrafter(num_nodes=2), 1, context_len=8, progress=False)
    # 3 forward widths, then propose only, then the engine step at the 3 widths
    assert t.widths == (0, 1, 2) and timed == [3, 1, 3] and t.idle_seconds == 0.0


def test_timed_draft_trips_see_a_moving_pending_token():
    """Each trip of the timed draft loop hands the drafter another pending token (and key), so a lookup
    that reads only the history cannot be hoisted out of the loop as loop-invariant: only the pending
    column changes, and stays a token of the vocabulary."""
    history = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 12)), jnp.int32)
    hist_len = jnp.asarray([5, 12], jnp.int32)
    key = jax.random.PRNGKey(0)
    ctx = [costmodel.trip_context(history, hist_len, key, jnp.int32(i), V, max_nodes=3) for i in range(3)]
    for i, c in enumerate(ctx):
        diff = np.asarray(c.history != history)
        want = np.zeros(history.shape, bool)
        want[0, 4] = want[1, 11] = i > 0
        np.testing.assert_array_equal(diff, want)
        assert int(c.history.min()) >= 0 and int(c.history.max()) < V and c.max_nodes == 3
        np.testing.assert_array_equal(c.hist_len, hist_len)
    assert not np.array_equal(np.asarray(ctx[0].key), np.asarray(ctx[1].key))


@pytest.mark.parametrize("sampled", [False, True])
def test_the_step_timing_runs_the_engine_at_each_forced_width(sampled):
    """Each whole-step loop verifies exactly its width, whatever the drafter proposed (prompt lookup on
    a random prompt finds nothing to propose), greedy or sampled with the default verifier."""
    from jaxdecode.sampling import SamplerConfig
    cfg, params = tiny(layers=1)
    widths = (0, 1, 2, 4)
    prompt = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, cfg.vocab_size, jnp.int32)
    loops, state0, plain_tokens = costmodel._forced_steps(
        cfg, params, PromptLookupDrafter(num_nodes=4), prompt, jnp.full((2,), 8, jnp.int32), widths,
        SamplerConfig(temperature=0.7 if sampled else 0.0), None, "xla", None, jax.random.PRNGKey(1), max_trips=2)
    # Prompt lookup is history_only: a plain trip is a lean run of max_depth + 1 = 5 plain steps, and
    # the measured width-0 time is divided by them (a price per plain token).
    assert plain_tokens == 5
    for i, loop in enumerate(loops):
        _, hist = loop._run(loop.args, jax.tree.map(lambda x: jnp.array(x, copy=True), state0), 2)
        per_trip = plain_tokens if i == 0 else 1
        assert np.asarray(hist).tolist() == [2 * per_trip if j == i else 0 for j in range(len(widths))], (i, hist)
    assert costmodel.cache_key((cfg, params), PromptLookupDrafter(num_nodes=4), 1)["verifier"] != \
        costmodel.cache_key((cfg, params), PromptLookupDrafter(num_nodes=4), 1, verifier="point_mass")["verifier"]


def test_measure_refuses_bad_requests():
    cfg, params = tiny()
    d = PromptLookupDrafter(num_nodes=4)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        costmodel.measure((cfg, params), d, 0)
    with pytest.raises(ValueError, match=r"context_len must be an int in 2\.\.251"):
        costmodel.measure((cfg, params), d, 1, context_len=300)
    with pytest.raises(TypeError, match="jaxdecode Model"):
        costmodel.measure("model", d, 1)


# ----------------------------------------------------------------------------- the cache
@pytest.fixture
def counted(monkeypatch):
    """Replace measure by a fake that records its calls and returns a table for the asked widths."""
    calls = []

    def fake(model, drafter, batch_size, *, widths, context_len, progress=True, **kw):
        sampled = kw.get("sampler") is not None and not kw["sampler"].is_greedy
        calls.append(dict(batch_size=batch_size, widths=widths, context_len=context_len, sampled=sampled))
        return table(widths=tuple(widths), batch_size=batch_size, steps=True,
                     meta={"context_len": context_len, "sampling": sampled})

    monkeypatch.setattr(costmodel, "measure", fake)
    return calls


def test_second_call_is_a_hit(tmp_path, counted):
    model, d = tiny(), PromptLookupDrafter(num_nodes=4)
    first = costmodel.load_or_calibrate(model, d, 2, cache_dir=tmp_path, progress=False)
    assert len(counted) == 1 and counted[0]["widths"] == (0, 1, 2, 4)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    second = costmodel.load_or_calibrate(model, d, 2, cache_dir=tmp_path, progress=False)
    assert len(counted) == 1 and second == first
    # Same context bucket (100 and 128 round up to 128): a hit; another bucket: a miss.
    costmodel.load_or_calibrate(model, d, 2, cache_dir=tmp_path, context_len=100, progress=False)
    costmodel.load_or_calibrate(model, d, 2, cache_dir=tmp_path, context_len=128, progress=False)
    assert len(counted) == 2 and counted[1]["context_len"] == 128
    costmodel.load_or_calibrate(model, d, 2, cache_dir=tmp_path, refresh=True, progress=False)
    assert len(counted) == 3


def test_generate_reads_the_nearest_cached_context(tmp_path, counted):
    """any_context (what generate and tree="auto" pass): a table cached for another context bucket serves
    instead of minutes of measuring; of several, the nearest by ratio (a tie: the longer). Without it, or
    with refresh, the asked-for bucket is measured. A sibling that does not read is passed over quietly."""
    model, d = tiny(), PromptLookupDrafter(num_nodes=4)

    def get(ctx, **kw):
        return costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, context_len=ctx, progress=False, **kw)

    assert get(128).meta["context_len"] == 128 and len(counted) == 1
    assert get(16, any_context=True).meta["context_len"] == 128 and len(counted) == 1  # read, not measured
    assert get(16).meta["context_len"] == 16 and len(counted) == 2  # calibrate's own request: measured
    assert get(32, any_context=True).meta["context_len"] == 16  # 32 is 2x from 16, 4x from 128
    assert get(64, any_context=True).meta["context_len"] == 128  # 4x from 16, 2x from 128
    get(32)
    assert get(64, any_context=True).meta["context_len"] == 128  # as near as 32: the longer
    assert len(counted) == 3
    assert get(64, any_context=True, refresh=True).meta["context_len"] == 64 and len(counted) == 4
    for path in (tmp_path / "costs").glob("*.json"):  # every other bucket's file damaged
        if json.loads(path.read_text())["key"]["context_len"] != 16:
            path.write_text("not json")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get(8, any_context=True).meta["context_len"] == 16 and len(counted) == 4
    other = PromptLookupDrafter(num_nodes=2)  # everything else must match: another drafter is measured
    costmodel.load_or_calibrate(model, other, 1, cache_dir=tmp_path, context_len=8, any_context=True,
                                progress=False)
    assert len(counted) == 5


def test_a_sampling_temperature_is_keyed_as_sampled(tmp_path, counted):
    """The retrieval default is built for the call's temperature (its cut reads the rates measured there),
    which made every new temperature a new key and ~45 s of measuring on the embedded target. A step
    costs the same at any temperature above 0: greedy and sampled are two keys, not one per value."""
    from jaxdecode.drafters.retrieval import RetrievalDrafter
    from jaxdecode.sampling import SamplerConfig
    model = tiny()

    def get(t):
        d = RetrievalDrafter(table=None, num_nodes=4, history_ngram=3, temperature=t)
        costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False, sampler=SamplerConfig(t))
        return len(counted)

    assert get(0.0) == 1 and get(0.7) == 2 and get(0.9) == 2 and get(1.5) == 2 and get(0.0) == 2
    desc = costmodel._temperature_class({"temperature": "0.7", "inner": [{"temperature": "0.0"}], "x": "0.7"})
    assert desc == {"temperature": "sampled", "inner": [{"temperature": "greedy"}], "x": "0.7"}


def test_cache_dir_from_the_environment(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path / "jd"))
    costmodel.load_or_calibrate(tiny(), PromptLookupDrafter(num_nodes=2), 1, progress=False)
    assert len(list((tmp_path / "jd" / "costs").glob("*.json"))) == 1
    monkeypatch.delenv("JAXDECODE_CACHE_DIR")
    monkeypatch.delenv("JAXDECODE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert costmodel.default_cache_dir() == tmp_path / "xdg" / "jaxdecode"
    # one root for every cache: compiled automata and grammars go beside the cost tables
    from jaxdecode.constraints import automaton, grammar
    assert automaton._cache_dir() == tmp_path / "xdg" / "jaxdecode" / "automata"
    monkeypatch.setattr(automaton, "tokenizer_fingerprint", lambda tok: "fp")
    assert grammar._cache_path("start: \"a\"", None, 4, ()).parent == tmp_path / "xdg" / "jaxdecode" / "grammars"
    monkeypatch.setenv("JAXDECODE_CACHE", str(tmp_path / "old"))  # the automata's earlier variable still works
    assert automaton._cache_dir() == tmp_path / "old" / "automata" and costmodel.default_cache_dir() == tmp_path / "old"


def test_changes_are_misses(tmp_path, monkeypatch, counted):
    model, d = tiny(), PromptLookupDrafter(num_nodes=4)

    def get(m=model, drafter=d, b=1):
        costmodel.load_or_calibrate(m, drafter, b, cache_dir=tmp_path, progress=False)
        return len(counted)

    assert get() == 1 and get() == 1
    cfg, params = model
    assert get(m=(cfg, jax.tree.map(lambda x: x * 1.5, params))) == 2  # other parameters, same config
    assert get(m=tiny(layers=3)) == 3  # another config
    assert get(drafter=PromptLookupDrafter(num_nodes=8)) == 4  # another tree size
    assert get(drafter=PromptLookupDrafter(num_nodes=4, max_ngram=2)) == 5  # another static field
    assert get(b=4) == 6  # another batch size
    fingerprint, real = costmodel.device_fingerprint, costmodel.device_fingerprint()
    monkeypatch.setattr(costmodel, "device_fingerprint", lambda: dict(real, device_kind="NVIDIA H200"))
    assert get() == 7  # another device
    monkeypatch.setattr(costmodel, "device_fingerprint", fingerprint)
    assert get() == 7 and get(b=4) == 7  # each one cached on its own
    # XLA calls every CPU "cpu": the host CPU model and core count are part of the key
    assert real["host_cpu"] == costmodel.host_cpu() and real["host_cores"] == os.cpu_count()
    this_cpu = costmodel.host_cpu
    monkeypatch.setattr(costmodel, "host_cpu", lambda: "GenuineIntel / 6 / 143 / Intel Xeon")
    assert get() == 8  # the same cache directory on another CPU
    monkeypatch.setattr(costmodel, "host_cpu", this_cpu)
    assert get() == 8
    from jaxdecode.sharding import make_mesh
    mesh = make_mesh(data=2, model=1, devices=jax.devices()[:2])
    costmodel.load_or_calibrate(model, d, 2, cache_dir=tmp_path, progress=False, mesh=mesh)
    assert len(counted) == 9  # sharded over a mesh
    from jaxdecode.sampling import SamplerConfig
    costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False, sampler=SamplerConfig(0.0))
    assert len(counted) == 9  # greedy: as without a sampler
    costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False, sampler=SamplerConfig(0.7))
    assert len(counted) == 10  # sampled drafts


def test_draft_model_weights_are_part_of_the_key(tmp_path, counted):
    dcfg, p1 = tiny(1, layers=1)
    _, p2 = tiny(2, layers=1)
    for p in (p1, p2, p1):
        costmodel.load_or_calibrate(tiny(), DraftLM(params=p, config=dcfg, builder=parse_tree_spec("chain:2")),
                                    1, cache_dir=tmp_path, progress=False)
    assert len(counted) == 2


@pytest.mark.parametrize("content", [
    b"\x00\xff garbage \x80",
    b'{"schema": 1, "key": {}, "table": {}}',  # valid JSON, another key
    b"[1, 2, 3]",
    b"",
])
def test_corrupt_cache_file_is_rebuilt_with_a_warning(tmp_path, counted, content):
    model, d = tiny(), PromptLookupDrafter(num_nodes=4)
    first = costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False)
    (path,) = (tmp_path / "costs").glob("*.json")
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="measured again"):
        again = costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False)
    assert again == first and len(counted) == 2
    assert CostTable.from_json(json.loads(path.read_text())["table"]) == first  # the file is whole again
    assert costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False) == first
    assert len(counted) == 2


def test_wrong_schema_table_is_rebuilt(tmp_path, counted):
    model, d = tiny(), PromptLookupDrafter(num_nodes=4)
    costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False)
    (path,) = (tmp_path / "costs").glob("*.json")
    data = json.loads(path.read_text())
    data["table"]["widths"] = "0,1,2,4"  # right key, a table of the wrong shape
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="not a valid cost table"):
        costmodel.load_or_calibrate(model, d, 1, cache_dir=tmp_path, progress=False)
    assert len(counted) == 2


# ----------------------------------------------------------------------------- the command
def test_cli_calibrate_prints_a_table(tiny_llama_dir, tmp_path, capsys, counted):
    from jaxdecode.cli import main
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--drafter", "prompt_lookup", "--tree", "chain:4",
            "--batch-size", "1,2", "--context-len", "32", "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split() == ["batch", "ms", "at", "width", "0", "1", "2", "4", "draft", "idle", "catch-up/token",
                                "source"]
    assert [line.split()[:2] for line in lines[2:6]] == [["1", "verify"], ["1", "whole"], ["2", "verify"],
                                                         ["2", "whole"]] and "measured" in lines[2]
    assert lines[3].split()[3:7] == ["2.000", "3.000", "4.000", "6.000"]  # the whole step at widths 0, 1, 2, 4
    assert str(tmp_path / "costs") in out and [c["batch_size"] for c in counted] == [1, 2]
    assert main(argv + ["--json"]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in printed.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2] and not any(r["measured"] for r in rows)
    assert rows[0]["widths"] == [0, 1, 2, 4] and rows[0]["cache_file"].startswith(str(tmp_path))
    assert len(counted) == 2  # the second run read the cache
    # What --json printed is what generate's costs= reads: the table of the call's batch size.
    import jaxdecode
    saved = tmp_path / "costs.jsonl"
    saved.write_text(printed)
    model = jaxdecode.load(tiny_llama_dir)
    for prompts in (["ab"], ["ab", "cd"]):
        out = jaxdecode.generate(model, prompts, method="speculative", drafter="prompt_lookup", tree="chain:4",
                                 costs=str(saved), max_new_tokens=4)
        assert out[0].batch_stats["calibrate_seconds"] == 0.0
    with pytest.raises(ValueError, match=r"batch sizes \[1, 2\], not for this call's 3"):
        jaxdecode.generate(model, ["a", "b", "c"], method="speculative", drafter="prompt_lookup", tree="chain:4",
                           costs=str(saved), max_new_tokens=4)
    (tmp_path / "one.json").write_text(json.dumps(rows[1], indent=1))  # one table, laid out on many lines
    out = jaxdecode.generate(model, ["ab", "cd"], method="speculative", drafter="prompt_lookup", tree="chain:4",
                             costs=str(tmp_path / "one.json"), max_new_tokens=4)
    assert len(counted) == 2  # nothing measured anew
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="not a readable cost table \\(the file is empty\\)"):
        jaxdecode.generate(model, ["ab"], method="speculative", drafter="prompt_lookup", tree="chain:4",
                           costs=str(tmp_path / "empty.json"), max_new_tokens=4)


@pytest.mark.parametrize("via", ["cli", "python"])
def test_calibrate_writes_the_table_generate_reads(tiny_llama_dir, tmp_path, monkeypatch, capsys, counted, via):
    """A drafter with verify widths of its own (the embedded target's retrieval default has them): what
    `jaxdecode calibrate` / load_or_calibrate measure is keyed at the widths generate's policy verifies
    over (costmodel.policy_widths), so generate reads it and measures nothing. The table used to be keyed
    at 0, powers of two and N alone, and generate measured again under another key."""
    import jaxdecode
    from jaxdecode.cli import main
    from jaxdecode.drafters import make_drafter
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    model = jaxdecode.load(tiny_llama_dir)
    if via == "cli":  # DEL self-speculation stops early: it verifies the node counts of its levels (3, 6)
        gen = dict(drafter="del", tree="static:3,1")
        assert main(["calibrate", "--model", str(tiny_llama_dir), "--drafter", "del", "--tree", "static:3,1",
                     "--context-len", "8", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["measured"]
    else:  # lengths (1, 3, 8): a 3-token draft is verified at width 3
        gen = dict(drafter="prompt_lookup", tree="chain:8", drafter_options={"lengths": [1, 3, 8]})
        drafter = make_drafter("prompt_lookup", model, tree="chain:8", lengths=(1, 3, 8))
        costmodel.load_or_calibrate(model, drafter, 1, context_len=8, progress=False)
    assert len(counted) == 1 and 3 in counted[0]["widths"]  # not a width of 0, powers of two, N
    out = jaxdecode.generate(model, [[5, 6, 7]], method="speculative", max_new_tokens=4, **gen)  # context 5 -> 8
    assert len(counted) == 1 and out[0].tokens  # a hit: nothing measured
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1


def test_policy_widths_are_the_default_of_the_cost_tables():
    d = PromptLookupDrafter(num_nodes=8, lengths=(1, 3, 8))
    assert costmodel.policy_widths(PromptLookupDrafter(num_nodes=8)) == costmodel.default_widths(8)
    assert costmodel.policy_widths(d) == (0, 1, 2, 3, 4, 8)  # the drafter's own widths join
    assert costmodel.policy_widths(d, [6]) == (0, 1, 2, 3, 4, 6, 8)  # and the call's verify_widths option
    assert costmodel.cache_key(tiny(), d, 1)["widths"] == [0, 1, 2, 3, 4, 8]


def test_calibration_and_auto_tree_are_reported_apart_from_seconds(tiny_llama_dir, tmp_path, monkeypatch,
                                                                   counted):
    """A first call measures its step costs (calibrate_seconds) and chooses tree="auto" (tree_auto_seconds)
    before it decodes: both, their compiles included, stay out of seconds and compile_seconds, so the
    figures add up to no more than the call's wall time. They used to be in seconds (a first call's
    tokens/s 40-100x low), and calibration's compiles in compile_seconds as well."""
    import time

    import jaxdecode
    from jax import monitoring
    from jaxdecode import treeopt
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    pause = 0.3

    def busy():  # wall time, part of it compiling, as measuring or profiling spends it
        time.sleep(pause)
        monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", pause / 2)

    fake = costmodel.measure
    monkeypatch.setattr(costmodel, "measure", lambda *a, **kw: (busy(), fake(*a, **kw))[1])

    def auto(*a, **kw):  # tree="auto", reporting its time as treeopt does
        start = time.perf_counter()
        busy()
        return "chain:2", {"tree_auto_seconds": round(time.perf_counter() - start, 4)}

    monkeypatch.setattr(treeopt, "resolve_auto_tree", auto)
    model = jaxdecode.load(tiny_llama_dir)
    start = time.perf_counter()
    out = jaxdecode.generate(model, ["import os"], method="speculative", drafter="prompt_lookup", tree="auto",
                             max_new_tokens=4)
    wall = time.perf_counter() - start
    stats = out[0].batch_stats
    assert len(counted) == 1 and stats["calibrate_seconds"] >= pause and stats["tree_auto_seconds"] >= pause
    parts = stats["seconds"] + (stats["compile_seconds"] or 0.0) + stats["calibrate_seconds"] \
        + stats["tree_auto_seconds"]
    assert parts <= wall + 1e-3, stats  # each counted once (rounding to 0.1 ms aside)


def test_drafter_loading_is_reported_apart_from_seconds(tiny_llama_dir, monkeypatch):
    """Building the drafter (a draft model read from a path, a trained drafter's weights, the retrieval
    datastore's table: 2.4 s for the embedded target's default on a first call) is drafter_load_seconds,
    not in seconds; it was in seconds, and a first call's 32 tokens looked 100x slower than the next."""
    import time

    import jaxdecode
    import jaxdecode.drafters as drafters
    model = jaxdecode.load(tiny_llama_dir)
    kw = dict(method="speculative", drafter="prompt_lookup", tree="chain:2", max_new_tokens=4, adaptive=False)
    jaxdecode.generate(model, ["import os"], **kw)  # compiled
    real = drafters.make_drafter
    monkeypatch.setattr(drafters, "make_drafter", lambda *a, **k: (time.sleep(0.5), real(*a, **k))[1])
    start = time.perf_counter()
    stats = jaxdecode.generate(model, ["import os"], **kw)[0].batch_stats
    wall = time.perf_counter() - start
    assert stats["drafter_load_seconds"] >= 0.5 and stats["seconds"] < 0.5, stats
    assert stats["seconds"] + stats["compile_seconds"] + stats["drafter_load_seconds"] <= wall + 1e-3
    draft = jaxdecode.generate(model, ["import os"], method="speculative", draft=str(tiny_llama_dir),
                               tree="chain:2", max_new_tokens=4, adaptive=False)[0].batch_stats
    assert draft["drafter_load_seconds"] > 0  # the draft model read from its directory


def test_costs_of_another_batch_size_are_refused(tiny_llama_dir, tmp_path, counted):
    """costs= (a CostTable, or a file with one table) measured at batch size 2 does not price a batch-1
    call: an error naming both sizes and the fix, as for a file with several tables of other sizes."""
    import jaxdecode
    model = jaxdecode.load(tiny_llama_dir)
    two = table(widths=(0, 1, 2), batch_size=2, steps=True)
    (tmp_path / "b2.json").write_text(json.dumps(two.to_json()))
    kw = dict(method="speculative", drafter="prompt_lookup", tree="chain:2", max_new_tokens=4)
    for costs in (two, str(tmp_path / "b2.json")):
        with pytest.raises(ValueError, match=r"batch size 2, not .*this call's 1: calibrate for it.*"
                                             r"--batch-size 1 --json"):
            jaxdecode.generate(model, ["import os"], costs=costs, **kw)
    assert len(counted) == 0  # refused, not measured instead
    out = jaxdecode.generate(model, ["import os", "x = 1"], costs=two, **kw)  # its own batch size: used
    assert out[0].batch_stats["calibrate_seconds"] == 0.0 and len(counted) == 0


def test_costs_for_another_setup_are_refused(tiny_llama_dir, tmp_path, counted):
    """A costs= table (object or file) is checked against what its meta records: the drafter's type and node
    count, the compute and weight dtypes, greedy or sampled decoding and the mesh. A greedy table object priced a
    sampled call, and a retrieval table a prompt-lookup or bf16 call, without a word. The hint names the
    call's temperature (following a hint without it led to the next error)."""
    import jaxdecode
    model = jaxdecode.load(tiny_llama_dir)
    kw = dict(method="speculative", drafter="prompt_lookup", tree="chain:2", max_new_tokens=4)
    fit = dict(drafter="PromptLookupDrafter", num_nodes=2, dtype=model.config.dtype,
               weights_dtype=costmodel.weights_dtype(model.params) + "/uint16", sampling=False)
    base = table(widths=(0, 1, 2), steps=True, meta=fit)
    jaxdecode.generate(model, ["import os"], costs=base, **kw)  # fits (the uint16 view is not a weight)
    for change, match in [(dict(drafter="RetrievalDrafter"), "drafter RetrievalDrafter, but this call has "
                                                              "PromptLookupDrafter"),
                          (dict(num_nodes=16), "tree size .nodes. 16, but this call has 2"),
                          (dict(weights_dtype="bfloat16"), "weight dtype bfloat16, but this call has float32"),
                          (dict(dtype="bfloat16"), "compute dtype bfloat16"),
                          (dict(mesh="data=2,model=4"), "mesh data=2,model=4, but this call has one device")]:
        bad = dataclasses.replace(base, meta=dict(fit, **change))
        with pytest.raises(ValueError, match=f"costs= is a cost table measured for {match}.*--batch-size 1 --json"):
            jaxdecode.generate(model, ["import os"], costs=bad, **kw)
        (tmp_path / "t.json").write_text(json.dumps(bad.to_json()))
        with pytest.raises(ValueError, match="t.json' holds a cost table measured for " + match):
            jaxdecode.generate(model, ["import os"], costs=str(tmp_path / "t.json"), **kw)
    with pytest.raises(ValueError, match=r"decoding greedy, but this call has sampled.*--temperature 0.7 --json"):
        jaxdecode.generate(model, ["import os"], costs=base, temperature=0.7, seed=0, **kw)
    with pytest.raises(ValueError, match=r"batch size 1, not at this call's 2:.*--batch-size 2 --temperature 0.7"):
        jaxdecode.generate(model, ["import os", "x"], costs=base, temperature=0.7, seed=0, **kw)
    many = tmp_path / "many.jsonl"  # two temperatures x batch sizes 1, 2: each size named once
    many.write_text("\n".join(json.dumps(dataclasses.replace(base, batch_size=b, meta=dict(fit, sampling=s))
                                          .to_json()) for s in (False, True) for b in (1, 2)))
    with pytest.raises(ValueError, match=r"cost tables for batch sizes \[1, 2\], not for this call's 3"):
        jaxdecode.generate(model, ["a", "b", "c"], costs=str(many), **kw)
    assert len(counted) == 0


def test_cli_calibrate_says_what_it_cannot_do(tiny_llama_dir, tmp_path, capsys, counted, monkeypatch):
    """--tree auto is chosen by generate (an error saying so, not "unknown tree spec"); a --cache-dir that
    generate does not read gets a note naming JAXDECODE_CACHE_DIR."""
    from jaxdecode.cli import main
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path / "default"))
    base = ["calibrate", "--model", str(tiny_llama_dir), "--drafter", "prompt_lookup", "--context-len", "16"]
    assert main(base + ["--tree", "auto"]) == 2
    assert "--tree auto is chosen by `jaxdecode generate` on first use" in capsys.readouterr().err
    assert main(base + ["--tree", "chain:2", "--cache-dir", str(tmp_path / "elsewhere")]) == 0
    assert f"set JAXDECODE_CACHE_DIR={tmp_path / 'elsewhere'} for them" in capsys.readouterr().err
    assert main(base + ["--tree", "chain:2", "--cache-dir", str(tmp_path / "default")]) == 0
    assert "JAXDECODE_CACHE_DIR" not in capsys.readouterr().err


def test_refused_pairs_are_refused_before_measuring(tiny_llama_dir, counted):
    """Under the adaptive default the engine's own checks run before the step costs are measured: a
    verifier the temperature or the drafter does not fit is refused at once with the engine's message (it
    was measured first, then refused by the verifier's input check, which never named the temperature)."""
    import jaxdecode
    from jaxdecode.speculative import SpeculativeError
    model = jaxdecode.load(tiny_llama_dir)
    kw = dict(method="speculative", drafter="prompt_lookup", tree="chain:2", max_new_tokens=4)
    with pytest.raises(SpeculativeError, match="samples but the temperature is 0.0"):
        jaxdecode.generate(model, ["import os"], verifier="specinfer", **kw)
    with pytest.raises(SpeculativeError, match="verifier .block. is lossless only for.*point_mass, topk"):
        jaxdecode.generate(model, ["import os"], verifier="block", temperature=0.5, **kw)
    assert len(counted) == 0


def test_cli_calibrate_does_not_claim_a_cache_it_could_not_write(tiny_llama_dir, tmp_path, capsys, counted):
    from jaxdecode.cli import main
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would be")
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--drafter", "prompt_lookup", "--tree", "chain:2",
            "--batch-size", "1", "--context-len", "16", "--cache-dir", str(blocked)]
    with pytest.warns(UserWarning, match="cannot write the cost cache .* CLI --cache-dir") as said:
        assert main(argv) == 0
    assert len(said) == 1  # a cache that cannot exist is a plain miss when read, not a second warning
    assert "batch 1: not cached (the cache could not be written)" in capsys.readouterr().out
    with pytest.warns(UserWarning):
        assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["cache_file"] is None


def test_cli_calibrate_measures_the_sampled_table_too(tiny_llama_dir, tmp_path, capsys, counted, monkeypatch):
    """`--temperature 0,0.7`: a greedy and a sampled table (a sampled step costs more), each what generate
    reads at its temperature, at any context (the nearest bucket); a costs= file picks the table of the
    call's decoding, and one holding only the other decoding's is refused."""
    import jaxdecode
    from jaxdecode.cli import main
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--drafter", "prompt_lookup", "--tree", "chain:2",
            "--batch-size", "1,2", "--context-len", "32", "--temperature", "0,0.7"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("nodes, greedy)") == 1 and out.count("nodes, sampled)") == 1
    assert [(c["batch_size"], c["sampled"]) for c in counted] == [(1, False), (2, False), (1, True), (2, True)]
    assert main(argv + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch_size"], r["temperature"], r["meta"]["sampling"]) for r in rows] == [
        (1, 0.0, False), (2, 0.0, False), (1, 0.7, True), (2, 0.7, True)]
    model = jaxdecode.load(tiny_llama_dir)
    kw = dict(method="speculative", drafter="prompt_lookup", tree="chain:2", max_new_tokens=4)
    for t in (0.0, 0.5, 1.2):  # prompt 3 + 4 // 2 tokens: context 8, read from the 32 bucket
        jaxdecode.generate(model, ["abc"], temperature=t, seed=0, **kw)
    assert len(counted) == 4  # nothing measured by generate
    both = tmp_path / "both.jsonl"
    both.write_text("\n".join(json.dumps(r) for r in rows))
    greedy_only = tmp_path / "greedy.jsonl"
    greedy_only.write_text("\n".join(json.dumps(r) for r in rows[:2]))
    jaxdecode.generate(model, ["abc"], temperature=0.8, seed=0, costs=str(both), **kw)
    with pytest.raises(ValueError, match=r"holds a greedy cost table for batch size 1, not a sampled one.*"
                                         r"--temperature 0.7 --json"):
        jaxdecode.generate(model, ["abc"], temperature=0.8, seed=0, costs=str(greedy_only), **kw)
    from jaxdecode.decoders import _costs_from_file
    assert _costs_from_file(both, 2, sampled=True).meta["sampling"] is True
    assert _costs_from_file(both, 2, sampled=False).meta["sampling"] is False


@pytest.mark.parametrize("temps, match", [("x", "numbers >= 0"), ("-1", ">= 0"), ("0,0", "repeats"),
                                          ("0.7,0.9", "shares one table"), ("nan", "finite")])
def test_cli_bad_temperatures(temps, match, capsys):
    from jaxdecode.cli import main
    assert main(["calibrate", "--model", "unused", "--temperature", temps]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("sizes, match", [("0", ">= 1"), ("1,x", "ints >= 1"), ("4,4", "repeats"), ("", "ints")])
def test_cli_bad_batch_sizes(sizes, match, capsys):
    from jaxdecode.cli import main
    assert main(["calibrate", "--model", "unused", "--batch-size", sizes]) == 2
    assert match in capsys.readouterr().err
