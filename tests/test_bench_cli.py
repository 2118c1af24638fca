"""`jaxdecode bench`, compile time reported apart by generate, and `python -m jaxdecode`."""
import json
import subprocess
import sys

import pytest

import jaxdecode
from jaxdecode.bench import ROW_FIELDS, BenchError, CompileClock, batches_of, parse_method, prepare_methods
from jaxdecode.cli import main


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return jaxdecode.load(tiny_llama_dir)


def test_generate_reports_compile_seconds_apart(model):
    # eos_ids is a static argument: ids no other test uses make this call compile, whatever ran before
    eos = (301, 302, 303)
    first = jaxdecode.generate(model, ["import sys"], method="greedy", max_new_tokens=5, eos_ids=eos)[0].batch_stats
    assert first["compile_seconds"] > 0
    assert first["seconds"] < first["compile_seconds"]  # a tiny model decodes 5 tokens faster than XLA compiles
    again = jaxdecode.generate(model, ["import sys"], method="greedy", max_new_tokens=5, eos_ids=eos)[0].batch_stats
    assert again["compile_seconds"] < 0.01
    assert again["seconds"] < first["compile_seconds"]


def test_compile_clock_counts_overlapping_events_once():
    from jax import monitoring
    with CompileClock() as clock:
        # an outer event spanning an inner one: only the outer span counts
        monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 0.0)
        monitoring.record_event_duration_secs("/jax/core/compile/jaxpr_trace_duration", 50.0)
        monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 10.0)
        monitoring.record_event_duration_secs("/jax/compilation_cache/compile_time_saved_sec", 99.0)
    assert 50.0 <= clock.seconds < 50.5


def test_compile_clock_without_jax_listeners_says_unknown(monkeypatch):
    from jax import monitoring
    monkeypatch.delattr(monitoring, "register_event_duration_secs_listener")  # another JAX line
    with CompileClock() as clock:
        pass
    assert clock.seconds is None  # unknown, never a silent 0


def test_python_dash_m_jaxdecode():
    out = subprocess.run([sys.executable, "-m", "jaxdecode", "methods"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "greedy" in out.stdout and "speculative" in out.stdout


def test_method_strings():
    assert parse_method("greedy") == ("greedy", {})
    assert parse_method("spec:drafter=prompt_lookup,tree=static:3,2,1,verifier=topk") == (
        "speculative", {"drafter": "prompt_lookup", "tree": "static:3,2,1", "verifier": "topk"})
    assert parse_method("speculative:tree=eagle:depth=5,topk=8,total=32,seed=1")[1] == {
        "tree": "eagle:depth=5,topk=8,total=32", "seed": 1}
    assert parse_method("speculative:tree=auto:width=8,depth=6,verifier=greedy")[1] == {
        "tree": "auto:width=8,depth=6", "verifier": "greedy"}
    assert parse_method('speculative:drafter_options={"lengths":[1,3,8]},verify-widths=[2,4]')[1] == {
        "drafter_options": {"lengths": [1, 3, 8]}, "verify_widths": [2, 4]}
    assert parse_method("sample:temperature=0.7")[1] == {"temperature": 0.7}


def test_same_as_first_only_compares_argmax_decoding():
    from jaxdecode.bench import _argmax_decoding
    assert _argmax_decoding("greedy", {}) and _argmax_decoding("speculative", {})  # spec: T=0 default
    assert _argmax_decoding("sample", {"temperature": 0})
    assert not _argmax_decoding("sample", {}) and not _argmax_decoding("speculative", {"temperature": 0.7})
    assert not _argmax_decoding("greedy", {"repetition_penalty": 1.3})
    assert not _argmax_decoding("beam", {})


def test_batches_fill_the_last_batch_from_the_start():
    assert batches_of(5, 2) == ([[0, 1], [2, 3], [4, 0]], 1)
    assert batches_of(2, 4) == ([[0, 1, 0, 1]], 2)
    assert batches_of(4, 2) == ([[0, 1], [2, 3]], 0)


def test_bench_json_rows(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import sys\n\nfor i in\n")  # blank lines skipped; both prompts 3 tokens
    rc = main(["bench", "--model", str(tiny_llama_dir), "--prompts-file", str(prompts),
               "--method", "greedy", "--method", "speculative:drafter=prompt_lookup,tree=chain:4",
               "--batch-size", "1,2", "--max-new-tokens", "8", "--json"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["method"].split(":")[0], r["batch_size"]) for r in rows] == [
        ("greedy", 1), ("speculative", 1), ("greedy", 2), ("speculative", 2)]
    for r in rows:
        assert tuple(r) == ROW_FIELDS
        assert r["prompts"] == 2 and r["padded_rows"] == 0 and r["new_tokens"] > 0
        assert r["tokens_per_second"] > 0 and r["compile_seconds"] >= 0
        assert r["target_calls_per_token"] > 0
    greedy, spec = rows[:2]
    assert greedy["speedup"] == 1.0 and rows[2]["speedup"] == 1.0  # the first method of each batch size
    assert all(r["same_as_first"] is True for r in rows)
    assert greedy["tau"] is None and greedy["accept_rate_by_depth"] is None
    assert spec["tau"] >= 1.0 and len(spec["accept_rate_by_depth"]) == 4
    assert spec["options"] == {"drafter": "prompt_lookup", "tree": "chain:4"}
    assert greedy["target_calls_per_token"] == 1.0  # plain decoding: one forward per token


@pytest.mark.parametrize("method, message", [
    ("nope", "unknown method 'nope'"),
    ("speculative:tree", "'tree' is not KEY=VALUE"),
    ("greedy:num_beams=3", "does not take option"),
    ("speculative:drafter=prompt_lookup,treee=chain:4", "unknown option 'treee'"),
    ("speculative:temperature=hot", "temperature must be a finite number"),
    ("speculative:tree=chian:4", "unknown tree spec 'chian:4'"),
    ("speculative:tree=eagle:depth=3,topk=2,totl=4", "unknown setting 'totl'"),
    ("speculative:tree=static:3,2,1,verifier=topk", "samples but the temperature is 0"),
    # a misspelt option after a tree spec of positional numbers is an option error, not int()'s
    ("speculative:drafter=prompt_lookup,tree=chain:4,vrifier=greedy", "unknown option 'vrifier'"),
    ("speculative:tree=static:3,2,1,verifier=greedy,sed=3", "unknown option 'sed'"),
    # after named settings it belongs to the spec; its error says which option it may be
    ("speculative:tree=auto:depth=8,vrifier=greedy", "is 'vrifier' a misspelt option 'verifier'?"),
    ("speculative:tree=auto:dpeth=8", "'auto' takes width=, depth="),
])
def test_bench_bad_method_strings(tmp_path, capsys, monkeypatch, method, message):
    import jaxdecode
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import sys\n")
    monkeypatch.setattr(jaxdecode, "load", lambda *a, **k: pytest.fail("a bad --method fails before any model loads"))
    rc = main(["bench", "--prompts-file", str(prompts), "--method", "greedy", "--method", method])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--method {method!r}" in err and message in err
    # With the bench-wide temperature the sampling verifier is fine; the greedy one is not.
    if "verifier=topk" in method:
        class Loads(Exception):
            pass

        def load(*a, **k):
            raise Loads  # the checks passed: the model would load now
        monkeypatch.setattr(jaxdecode, "load", load)
        with pytest.raises(Loads):
            main(["bench", "--prompts-file", str(prompts), "--method", method, "--temperature", "0.7"])


def test_bench_takes_auto_trees_with_settings():
    """tree="auto:SETTINGS" (generate takes it) passes bench's checks, as plain "auto" does."""
    for tree in ("auto", "auto:depth=8", "auto:finalists=1",
                 "auto:width=8,depth=6,max_nodes=48,tokens=128,finalists=4"):
        [(_, name, options, _)] = prepare_methods([f"speculative:drafter=prompt_lookup,tree={tree},seed=1"],
                                                  max_new_tokens=4)
        assert (name, options) == ("speculative", {"drafter": "prompt_lookup", "tree": tree, "seed": 1})


def _drafter_dir(path, kind):
    """A directory whose config.json names a trained kind: all prepare_methods reads of it."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"jaxdecode_drafter": kind, "format_version": 1, "config": {},
                                                  "target": {}, "tensors": {}}))
    return str(path)


def test_bench_wide_draft_and_drafter_dir_go_only_where_they_fit(tmp_path):
    """The README's example: the method that names no drafter drafts with the bench-wide --draft (as
    `generate --draft` does), the bench-wide --drafter-dir goes to the method naming its kind; neither
    changes which drafter another method runs, and neither is dropped without a word."""
    medusa, accept = _drafter_dir(tmp_path / "medusa", "medusa"), _drafter_dir(tmp_path / "acc", "accept_head")

    def merged(methods, **kw):
        return [options for _, _, options, _ in prepare_methods(methods, max_new_tokens=4, **kw)]
    assert merged(["greedy", "speculative:tree=static:3,2,1,verifier=greedy", "speculative:drafter=medusa"],
                  draft="DRAFT", drafter_dir=medusa) == [
        {}, {"tree": "static:3,2,1", "verifier": "greedy", "draft": "DRAFT"},
        {"drafter": "medusa", "drafter_dir": medusa}]
    # alone, --drafter-dir runs its kind where no drafter is named (generate --drafter-dir)
    assert merged(["speculative:tree=chain:3"], drafter_dir=medusa) == [{"tree": "chain:3", "drafter_dir": medusa}]
    # drafters that draft with a draft model get it; others neither it nor the directory of another kind
    assert merged(["speculative:drafter=draft_lm", "speculative:drafter=dllm", "speculative:drafter=prompt_lookup",
                   "speculative:drafter=accept_head", "speculative:drafter=hydra"],
                  draft="DRAFT", drafter_dir=accept) == [
        {"drafter": "draft_lm", "draft": "DRAFT"}, {"drafter": "dllm", "draft": "DRAFT"},
        {"drafter": "prompt_lookup"}, {"drafter": "accept_head", "draft": "DRAFT", "drafter_dir": accept},
        {"drafter": "hydra"}]
    # a method's own drafter_dir: the bench-wide draft only when that kind drafts with one
    assert merged([f"speculative:drafter_dir={medusa}", "speculative:drafter=draft_lm"], draft="DRAFT") == [
        {"drafter_dir": medusa}, {"drafter": "draft_lm", "draft": "DRAFT"}]
    # no drafter named, a draft model and a directory whose kind also drafts with one: either could run
    with pytest.raises(BenchError, match="names no drafter and gets both .* drafter=accept_head or drafter=draft_lm"):
        merged(["speculative"], draft="DRAFT", drafter_dir=accept)
    with pytest.raises(BenchError, match="--draft is used by no --method"):
        merged(["greedy", "speculative:drafter=prompt_lookup"], draft="DRAFT")
    with pytest.raises(BenchError, match="--drafter-dir is used by no --method.*drafter=medusa"):
        merged(["speculative:drafter=hydra", "speculative:drafter=draft_lm"], draft="DRAFT", drafter_dir=medusa)
    with pytest.raises(BenchError, match="--drafter-dir .*missing.*does not exist"):
        merged(["speculative"], drafter_dir=str(tmp_path / "missing"))


def test_bench_readme_draft_model_method_runs_the_draft_model(model, tiny_llama_dir, tmp_path, capsys):
    """The README's example, with a retrieval datastore as the bench-wide --drafter-dir: the method written
    with `--draft DIR` drafts with that model (the target as its own draft model is accepted at every
    depth, which no other drafter would be on a random model), the directory goes to the retrieval method."""
    import numpy as np

    from jaxdecode.drafters.retrieval import RetrievalConfig, datastore_params
    from jaxdecode.drafters.trained import save_drafter
    store = str(save_drafter(tmp_path / "retrieval", "retrieval", RetrievalConfig(),
                             datastore_params(np.ones((2, 5), int), [5, 5], [1, 1]), model.config))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import sys\n")
    rc = main(["bench", "--model", str(tiny_llama_dir), "--prompts-file", str(prompts), "--max-new-tokens", "7",
               "--method", "greedy",
               "--method", "speculative:tree=chain:2,verifier=greedy", "--draft", str(tiny_llama_dir),
               "--method", "speculative:drafter=retrieval", "--drafter-dir", store, "--json"])
    assert rc == 0
    greedy, spec, retrieval = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert spec["options"] == {"tree": "chain:2", "verifier": "greedy", "draft": str(tiny_llama_dir)}
    assert spec["accept_rate_by_depth"] == [1.0, 1.0] and spec["same_as_first"] is True
    assert retrieval["options"] == {"drafter": "retrieval", "drafter_dir": store}
    assert retrieval["same_as_first"] is True


def test_bench_reads_prompts_files_as_generate_does(tmp_path):
    """bench splits a prompts file as `jaxdecode generate --prompts-file` does (str.splitlines: a form
    feed, CRLF and U+2028 end a line too; blank lines skipped); .jsonl files alike."""
    from jaxdecode.bench import read_prompts
    from jaxdecode.cli import read_prompts_file
    text = tmp_path / "prompts.txt"
    text.write_text("def f(x):\x0c    return x\r\nimport os\u2028x = 1\n\n  \nfor i in\n", encoding="utf-8")
    assert read_prompts(text) == read_prompts_file(text) == ["def f(x):", "    return x", "import os", "x = 1",
                                                             "for i in"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a\\fb"}\n\n{"ids": [1, 2]}\n')
    assert read_prompts(jsonl) == read_prompts_file(jsonl) == ["a\x0cb", [1, 2]]
    jsonl.write_text("not json\n")
    with pytest.raises(BenchError, match="not a JSON object"):
        read_prompts(jsonl)


def test_bench_bad_prompts_file_and_batch_sizes(tmp_path, capsys):
    assert main(["bench", "--prompts-file", str(tmp_path / "missing.txt"), "--method", "greedy"]) == 2
    err = capsys.readouterr().err
    assert "prompts file" in err and "does not exist" in err and "one prompt per line" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(["bench", "--prompts-file", str(empty), "--method", "greedy"]) == 2
    assert "no non-empty lines" in capsys.readouterr().err
    empty.write_text("x\n")
    assert main(["bench", "--prompts-file", str(empty), "--method", "greedy", "--batch-size", "1,0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    with pytest.raises(BenchError, match="give at least one --method"):
        from jaxdecode.bench import run_bench
        run_bench(None, ["x"], [])


def test_trace_decode_counts_each_op_once(monkeypatch):
    """benchmarks/trace_decode.py sums compiled ops from a profiler trace: a `while` thunk spans the ops
    of its body on the same thread, so only the ops that hold no other op count."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from trace_decode import leaf_ops

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "pid": 7, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": {"hlo_op": name}}

    events = [op("while.1", 0, 100), op("fusion.2", 10, 10), op("while.3", 30, 40), op("dot.4", 35, 5),
              op("fusion.5", 100, 10),  # starts where the loop ends: not inside it
              op("fusion.6", 5, 10, tid=2)]  # another thread's op overlaps the loop in time
    assert sorted(e["name"] for e in leaf_ops(events)) == ["dot.4", "fusion.2", "fusion.5", "fusion.6"]


HLO_DUMP = """HloModule jit__decode, is_scheduled=true

FileNames
1 "/somewhere/jaxdecode/models/transformer.py"
2 "/somewhere/jaxdecode/adaptive.py"
FunctionNames
1 "matmul"
2 "draft_plan"
FileLocations
1 {file_name_id=1 function_name_id=1 line=164 end_line=164 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=523 end_line=523 column=1 end_column=9}
StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%command_buffer.850 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fc.1, metadata={op_name="x" stack_frame_id=1}
  %fusion.2 = f32[4]{0} fusion(%fusion.1), kind=kLoop, calls=%fc.2, metadata={op_name="y" stack_frame_id=1}
  ROOT %fusion.3 = f32[4]{0} fusion(%fusion.2), kind=kLoop, calls=%fc.3, metadata={op_name="z" stack_frame_id=2}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %plan = f32[4]{0} fusion(%a), kind=kLoop, calls=%fc.4, metadata={op_name="w" stack_frame_id=2}
  %dot.7 = f32[4]{0} dot(%plan, %a), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %call.9 = f32[4]{0} call(%dot.7), to_apply=%command_buffer.850
}
"""


def test_trace_decode_names_the_code_behind_each_op(tmp_path, monkeypatch):
    """benchmarks/trace_decode.py charges a profile's ops to source functions read from XLA's HLO dump:
    an op's own stack frame; a command buffer (the profile's `command_buffer_850`) or a call: the
    functions its ops came from; an op XLA made without a frame: its inputs' source. A module compiled
    twice is read from the dump given first."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from trace_decode import HloSources, source_key

    first, other = tmp_path / "module_0001.jit__decode.txt", tmp_path / "module_0002.jit__decode.txt"
    first.write_text(HLO_DUMP)
    other.write_text(HLO_DUMP.replace("stack_frame_id=2", "stack_frame_id=1"))  # the module compiled again
    src = HloSources([first, other])  # the first that holds a module is the one read
    assert src.where("jit__decode", "plan") == "adaptive.py:draft_plan:523"
    assert src.where("jit__decode", "command_buffer_850") == "transformer.py:matmul x2; adaptive.py:draft_plan x1"
    assert src.where("jit__decode", "call.9") == "transformer.py:matmul x2; adaptive.py:draft_plan x1"
    assert src.where("jit__decode", "dot.7") == "near adaptive.py:draft_plan:523"
    assert src.where("jit__decode", "nothing.1") == "" and src.where("jit_other", "plan") == ""
    assert source_key("near adaptive.py:draft_plan:523") == "adaptive.py:draft_plan"
    assert source_key("transformer.py:matmul x2; adaptive.py:draft_plan x1") == "transformer.py:matmul"
    assert source_key("") == "?"
    assert HloSources([other, first]).where("jit__decode", "plan") == "transformer.py:matmul:164"
