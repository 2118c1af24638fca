"""Streaming (jaxdecode.stream): the pieces are the one-shot output, piece by piece, without recompiling."""
import io
import warnings

import jax
import numpy as np
import pytest

import jaxdecode
from jaxdecode.autoregressive import _decode, decode
from jaxdecode.options import OptionError
from jaxdecode.sampling import SamplerConfig
from jaxdecode.streaming import StreamError, TokenSink, _RowText, stop_holdback, stream, stream_to

PROMPTS = ["def add(a, b):", "import os"]
N = 12
SPEC = dict(drafter="prompt_lookup", tree="chain:3", adaptive=False)
CASES = {"greedy": {}, "sample": dict(seed=3, temperature=0.9), "speculative": SPEC}


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return jaxdecode.load(tiny_llama_dir)


def _by_row(pieces, rows: int) -> list[list[str]]:
    out = [[] for _ in range(rows)]
    for p in pieces:
        out[p.row].append(str(p))
    return out


@pytest.mark.parametrize("method", list(CASES))
def test_stream_equals_one_shot(model, method):
    ref = jaxdecode.generate(model, PROMPTS, method, N, eos_ids=(), **CASES[method])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tokenizer rewrite of streamed text would warn
        s = stream(model, PROMPTS, method, N, eos_ids=(), interval=0, every=1, **CASES[method])
        pieces = list(s)
    rows = _by_row(pieces, len(PROMPTS))
    assert [r.tokens for r in s.results] == [r.tokens for r in ref]
    assert ["".join(r) for r in rows] == [r.text for r in ref]
    assert all(isinstance(p, str) and p for p in pieces)
    assert max(len(r) for r in rows) > 1  # it arrived in pieces, not at the end


def test_second_stream_compiles_nothing_and_one_shot_has_no_callback(model):
    list(stream(model, "class", "greedy", N, eos_ids=()))
    size = _decode._cache_size()
    s = stream(model, "class", "greedy", N, eos_ids=())
    list(s)
    assert _decode._cache_size() == size
    assert s.results[0].batch_stats["compile_seconds"] in (0.0, None)
    toks, lens = np.array([[5, 6, 7]], np.int32), np.array([3], np.int32)

    def jaxpr(sink):
        return str(jax.make_jaxpr(lambda: decode(model.config, model.params, toks, lens, max_new_tokens=2,
                                                 sampler=SamplerConfig(temperature=0.0), method="greedy",
                                                 stream=sink))())
    assert "callback" not in jaxpr(None)
    sink = TokenSink()
    assert "callback" in jaxpr(sink)
    sink.close()


@pytest.mark.parametrize("method", ["greedy", "speculative"])
def test_stream_stops_before_stop_string(model, method):
    kw = dict(CASES[method], eos_ids=())
    full = jaxdecode.generate(model, PROMPTS[0], method, N, **kw)[0].text
    # Two characters inside the output (no U+FFFD: random weights emit stray bytes): the row stops there.
    stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    ref = jaxdecode.generate(model, PROMPTS[0], method, N, stop=stop, **kw)[0]
    assert ref.finish_reason == "stop"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # text shown past the stop string would not be a prefix: it warns
        s = stream(model, PROMPTS[0], method, N, stop=stop, interval=0, every=1, **kw)
        pieces = list(s)
    assert "".join(pieces) == ref.text and stop not in "".join(pieces)
    assert s.results[0].tokens == ref.tokens


def test_stop_holdback():
    assert stop_holdback("abc\n", ["\n\n"]) == 3  # "\n" may begin "\n\n"
    assert stop_holdback("abc\n\nxy", ["\n\n"]) == 3  # cut before the stop string
    assert stop_holdback("abcde", ["dex", "cdey"]) == 2  # the earliest possible start wins
    assert stop_holdback("abc", ["x"]) == 3


def test_row_text_holds_incomplete_utf8():
    text = "héllo wörld €!"
    data = list(text.encode())  # one byte per token: multi-byte characters span tokens

    def decode(toks):
        return bytes(int(t) for t in toks).decode("utf-8", errors="replace")
    row, shown = _RowText(decode), []
    for n in range(1, len(data) + 1):
        row.update(np.asarray(data[:n]))
        assert "\ufffd" not in row.text and text.startswith(row.text)
        shown.append(row.text)
    assert shown[-1] == text and len(set(shown)) > 5


def test_stream_to_and_errors(model):
    ref = jaxdecode.generate(model, PROMPTS, "greedy", N, eos_ids=())
    buf = io.StringIO()
    out = stream_to(buf, model, PROMPTS, "greedy", N, eos_ids=(), sep="|")
    assert buf.getvalue() == ref[0].text + "|" + ref[1].text + "|"
    assert [r.tokens for r in out] == [r.tokens for r in ref]
    with pytest.raises(StreamError, match="cannot stream"):
        stream(model, "x", "beam", N)
    s = stream(model, "x", "sample", N, top_k=-1)  # checked in the worker: raised to the consumer
    with pytest.raises(OptionError, match="top_k"):
        list(s)
    s = stream(model, "x", "greedy", N)
    with pytest.raises(StreamError, match="not finished"):
        _ = s.results


def test_abandoned_stream_stops_its_decode(model):
    n = 200
    s = stream(model, PROMPTS[0], "greedy", n, eos_ids=(), interval=0, every=1)
    job = s._job
    for _ in s:
        break
    del s  # dropped mid-decode: its sink closes, and the loop ends at its next step, not after n tokens
    job.thread.join(timeout=60)
    assert not job.thread.is_alive()
    assert job.results[0].stats["new_tokens"] < n
    s = stream(model, PROMPTS[0], "greedy", n, eos_ids=(), interval=0, every=1)
    next(s)
    s.close()
    s._job.thread.join(timeout=60)
    assert s._job.results[0].stats["new_tokens"] < n and list(s) == []


def test_stream_dropped_at_interpreter_exit_is_quiet(model, monkeypatch):
    """A stream kept in a module global is dropped during interpreter teardown, when the module's own
    globals (the sinks' lock) may already be None: its __del__ must not raise ("Exception ignored in")."""
    from jaxdecode import streaming
    s = stream(model, PROMPTS[0], "greedy", 4, eos_ids=())
    text = "".join(s)
    monkeypatch.setattr(streaming, "_SINKS_LOCK", None)  # as teardown leaves it
    s.__del__(_finalizing=lambda: True)
    monkeypatch.undo()  # before `s` is collected for real
    assert text == s.results[0].text


def test_stream_under_mesh(tiny_llama_dir):
    from jaxdecode.sharding import make_mesh
    mesh = make_mesh(data=2, model=4, devices=jax.devices()[:8])
    model = jaxdecode.load(tiny_llama_dir, mesh=mesh)
    ref = jaxdecode.generate(model, PROMPTS, "greedy", N, eos_ids=(), mesh=mesh)
    s = stream(model, PROMPTS, "greedy", N, eos_ids=(), mesh=mesh)
    rows = _by_row(list(s), len(PROMPTS))
    assert ["".join(r) for r in rows] == [r.text for r in ref]
    assert [r.tokens for r in s.results] == [r.tokens for r in ref]


def test_deliveries_every_n_tokens(model, monkeypatch):
    """every=4: one host delivery per 4 tokens per row (and at the end), each the whole output so far."""
    seen = []
    receive = TokenSink.receive

    def counting(self, tokens, counts, done):
        seen.append(counts.copy())
        return receive(self, tokens, counts, done)

    monkeypatch.setattr(TokenSink, "receive", counting)
    ref = jaxdecode.generate(model, PROMPTS[0], "greedy", 10, eos_ids=())[0]
    s = stream(model, PROMPTS[0], "greedy", 10, eos_ids=(), every=4)
    assert "".join(s) == ref.text and s.results[0].tokens == ref.tokens
    assert [int(c[0]) for c in seen] == [4, 8, 10]
    with pytest.raises(StreamError, match="every"):
        stream(model, PROMPTS[0], "greedy", 4, every=0)


def test_cli_stream_several_prompts(tiny_llama_dir, model, capsys):
    from jaxdecode.cli import main
    ref = jaxdecode.generate(model, ["def add(", "class"], "greedy", 5, eos_ids=(300,))
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "def add(", "--prompt", "class",
                 "--max-new-tokens", "5", "--eos-id", "300", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "def add(" + ref[0].text in out and "class" + ref[1].text in out and "batch stats:" in out
    assert "--- output 2 of 2" in out
