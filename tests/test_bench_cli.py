"""`jaxdecode bench`, compile time reported apart by generate, and `python -m jaxdecode`."""
import json
import subprocess
import sys

import pytest

import jaxdecode
from jaxdecode.bench import ROW_FIELDS, BenchError, CompileClock, batches_of, parse_method
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
    assert parse_method("speculative:tree=eagle:depth=5,topk=8,total=48,seed=1")[1] == {
        "tree": "eagle:depth=5,topk=8,total=48", "seed": 1}
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
