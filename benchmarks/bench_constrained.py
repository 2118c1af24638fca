"""Constrained decoding (STATIC) benchmark. Two sections, one run:

  peer   jaxdecode against the reference JAX implementation of STATIC (youtube/static-constraint-decoding,
         `sparse_transition_jax`) on the same items, the same logits function and the same shapes
         (default: 1e5 random items of length 8 over V 2048, batch 2, beams 8 and 70). The beams must be
         identical (asserted). Reported: whole-call time (median over repeats, compile excluded and
         reported apart), the ratio reference / jaxdecode (> 1: jaxdecode is faster), the compiled core
         alone (jaxdecode's jitted loop without the Python wrapper), bytes per item of both layouts,
         and compile times.
  steps  the constrained beam step against the unconstrained one and two host tries, whole constrained
         decodes (model-free and with a model), index build time and bytes per item, at growing item
         counts (default 1e5, 1e6, 1e7).

    python benchmarks/bench_constrained.py                          # both sections
    python benchmarks/bench_constrained.py --only peer --reference DIR --beams 8,70
    python benchmarks/bench_constrained.py --only steps --items 1e5,1e6 --no-model

The reference is not part of jaxdecode: it is used from `--reference DIR` (a checkout of the public
repository), else the directory in env STATIC_REFERENCE_DIR, else a shallow `git clone` of
https://github.com/youtube/static-constraint-decoding into ~/.cache/jaxdecode/ (once); without any of
them the peer section is skipped with a message saying how to provide it.

The shared logits function: logits[r] = table[step, (last token of beam r * 7919) % 251] for a fixed
random table (the reference's harness calls `model(input_ids, key)` with each beam's last token; the
"key" carries the table and the step), so both decoders see the same logits for the same beam and
their beams must agree exactly. The reference runs with tokens_per_beam = beams (its dense step is
then exact; its own benchmark uses 30 at beam 70, an approximation).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.index import build_index
from jaxdecode.constraints.search import trie_beam_search

REFERENCE_URL = "https://github.com/youtube/static-constraint-decoding"
HASH_ROWS = 251  # rows of the shared logits table per step (a beam's row: hash of its last token)
START = 0  # the reference's start token: the "last token" of every beam at step 0


# ----------------------------------------------------------------------------- the steps section
def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reference_layout_bytes(index) -> int:
    """Bytes of the reference (STATIC repository) layout for the same trie, dense depth d = 2."""
    v = index.vocab_size
    starts = index.level_start
    n_depth = [starts[lv + 1] - starts[lv] for lv in range(2, len(starts) - 1)]  # nodes after 1..L tokens
    edges = sum(n_depth[1:])  # transitions out of depth >= 1 nodes
    states = v + 1 + sum(n_depth[1:-1])  # level-0 ids 1..V, then non-leaf deeper nodes
    return (edges + v) * 8 + (states + 2) * 4 + v + v * v * 5


@partial(jax.jit, static_argnames=("b", "k"))
def unconstrained_step(logits, run_scores, *, b, k):
    """The plain beam step's selection: log_softmax, top-k over beams x V."""
    v = logits.shape[-1]
    cand = (run_scores[:, None] + jax.nn.log_softmax(logits, axis=-1)).reshape(b, -1)
    top, idx = jax.lax.top_k(cand, k)
    return top, idx // v, idx % v


@partial(jax.jit, static_argnames=("b", "k"))
def constrained_step(constraint, state, logits, run_scores, *, b, k):
    """The constrained beam step's selection, as beam search runs it: on the first step's b prompt rows
    each row's candidates, then its top-k; on the b x k beams each group's ranked candidates (one
    top-k over the group's beams x allowed tokens inside the constraint), then the beam step's top-k
    over those."""
    if logits.shape[0] == b * k:
        c = constraint.candidates(state, logits, k, scores=run_scores, min_depth=1)  # [b, n], parent
        cand = run_scores[jnp.arange(b)[:, None] * k + c.parent] + c.logprobs
        top, idx = jax.lax.top_k(cand, k)
        parent = jnp.take_along_axis(c.parent, idx, axis=1)
    else:
        c = constraint.candidates(state, logits, k, max_depth=0)  # [b, C]
        top, idx = jax.lax.top_k(run_scores[:, None] + c.logprobs, k)
        parent = jnp.zeros_like(idx)
    tok = jnp.take_along_axis(c.tokens, idx, axis=1)
    nxt = jnp.take_along_axis(c.next[0], idx, axis=1)
    return top, parent, tok, nxt


def cpu_trie_step(index, logits, nodes: np.ndarray, run_scores: np.ndarray, b: int, k: int):
    """Host baseline: logits to the host, log-softmax, per beam its CSR row (pointer walk) and that
    row's log-probs, then top-k over all beams."""
    x = np.asarray(logits, np.float32)
    m = x.max(axis=1, keepdims=True)
    logp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    r, v = logp.shape
    masked = np.full((r, v), -np.inf, np.float32)
    for i in range(r):
        s = int(nodes[i])
        lo, hi = int(index.indptr[s]), int(index.indptr[s + 1])
        toks = index.edge_token[lo:hi].astype(np.int64)
        masked[i, toks] = logp[i, toks]
    cand = (run_scores[:, None] + masked).reshape(b, -1)
    idx = np.argpartition(-cand, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(cand, idx, axis=1), axis=1)
    return np.take_along_axis(idx, order, axis=1)


def build_dict_trie(items: np.ndarray) -> dict:
    """The textbook host trie of generative retrieval code: nested dicts token -> child."""
    root: dict = {}
    for it in items.tolist():
        node = root
        for t in it:
            node = node.setdefault(t, {})
    return root


def dict_trie_step(trie: dict, logits, prefixes: list, run_scores: np.ndarray, b: int, k: int):
    """Host baseline 2, the `prefix_allowed_tokens_fn` pattern: per beam, walk its generated prefix
    from the root of a dict trie, list the allowed tokens, mask the host log-probs; top-k over beams."""
    x = np.asarray(logits, np.float32)
    m = x.max(axis=1, keepdims=True)
    logp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    masked = np.full(logp.shape, -np.inf, np.float32)
    for i, prefix in enumerate(prefixes):
        node = trie
        for t in prefix:
            node = node[t]
        allowed = np.fromiter(node.keys(), np.int64, len(node))
        masked[i, allowed] = logp[i, allowed]
    cand = (run_scores[:, None] + masked).reshape(b, -1)
    idx = np.argpartition(-cand, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(cand, idx, axis=1), axis=1)
    return np.take_along_axis(idx, order, axis=1)


def _states_at(index, items: np.ndarray, depth: int, rows: int, rng):
    """States of `rows` random item prefixes of `depth` tokens (what live beams hold), and the
    prefixes themselves."""
    pick = items[rng.integers(0, items.shape[0], rows)]
    out = np.empty(rows, np.int64)
    prefixes = []
    for i, it in enumerate(pick):
        prefixes.append(it[:depth].tolist())
        out[i] = index.walk(prefixes[-1])[-1]
    return out, prefixes


@dataclasses.dataclass(frozen=True)
class RandomLogits:
    """Random logits for the model-free decode (the STATIC repository's RandomModel); hashable."""
    vocab: int

    def __call__(self, key, tokens, step):
        return jax.random.normal(jax.random.fold_in(key, step), (tokens.shape[0], self.vocab))


def _model(vocab_hint: int):
    """The embedded target model, else the ~12 M llama of the brief (d 384, 6 layers, vocab 4096)."""
    from jaxdecode.api import embedded_model_path, load
    from jaxdecode.models import ModelConfig, init_params
    path = embedded_model_path("target")
    if path is not None:
        m = load(path)
        return m.config, m.params, f"embedded target ({path.name})"
    cfg = ModelConfig(model_type="llama", vocab_size=max(4096, vocab_hint), hidden_size=384, intermediate_size=1024,
                      num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.05)
    n = sum(x.size for x in jax.tree.leaves(params))
    return cfg, params, f"random llama d=384 x 6 layers, vocab {cfg.vocab_size} ({n / 1e6:.1f} M params)"


def _decode_step_time(cfg, params, rows: int, prompt: int, repeats: int) -> float:
    from jaxdecode.models import forward, init_cache
    cache = init_cache(cfg, rows, 64)
    cache = cache.replace(lengths=jnp.full((rows,), prompt, jnp.int32))
    tok = jnp.ones((rows, 1), jnp.int32)

    @jax.jit
    def step(params, cache):
        logits, _, cache = forward(cfg, params, tok, cache.lengths[:, None], cache, jnp.ones((rows, 1, 1), bool))
        return logits

    step(params, cache).block_until_ready()
    return median_time(lambda: step(params, cache), repeats)


def run_benchmark(items=(100_000,), vocab: int = 2048, length: int = 8, batch: int = 2, beams: int = 70,
                  model: bool = True, repeats: int = 20, seed: int = 0, dict_trie_max: int = 1_000_000) -> list:
    """The steps section (module docstring)."""
    rng = np.random.default_rng(seed)
    b, k, v, n_len = batch, beams, vocab, length
    r = b * k
    print(f"steps: V={v}, L={n_len}, batch={b}, beams={k} ({r} rows)", flush=True)
    logits = jnp.asarray(rng.normal(size=(r, v)).astype(np.float32) * 2)
    scores = jnp.asarray(-rng.random(r).astype(np.float32))
    # The first step expands only the batch's prompts (b rows), every later one b x k beams.
    first = (logits[:b], jnp.zeros((b,), jnp.float32))
    unc = [median_time(lambda: unconstrained_step(*first, b=b, k=k), repeats)]
    unc += [median_time(lambda: unconstrained_step(logits, scores, b=b, k=k), repeats)] * (n_len - 1)
    model_info = None
    if model:
        cfg, params, desc = _model(v)
        step_s = _decode_step_time(cfg, params, r, 16, max(5, repeats // 4))
        model_info = dict(model=desc, decode_step_ms=step_s * 1e3)
        print(json.dumps(model_info), flush=True)
    rows = []
    for n in items:
        item_arr = rng.integers(0, v, size=(n, n_len), dtype=np.int32)
        t0 = time.perf_counter()
        index = build_index(item_arr, v)
        build_s = time.perf_counter() - t0
        constraint = index.constraint()
        con, cpu, cpu_dict, compile_s = [], [], [], 0.0
        dict_trie = build_dict_trie(item_arr) if n <= dict_trie_max else None  # ~1.5 GB at 1e6
        for d in range(n_len):
            rows_d = b if d == 0 else r
            x, sc = (first if d == 0 else (logits, scores))
            nodes, prefixes = _states_at(index, item_arr, d, rows_d, rng)
            state = constraint.init(rows_d).replace(node=(jnp.asarray(nodes, jnp.int32),), depth=jnp.int32(d))
            t0 = time.perf_counter()
            jax.block_until_ready(constrained_step(constraint, state, x, sc, b=b, k=k))
            compile_s += time.perf_counter() - t0
            con.append(median_time(lambda: constrained_step(constraint, state, x, sc, b=b, k=k), repeats))
            sc_host = np.asarray(sc)
            host = lambda: cpu_trie_step(index, x, nodes, sc_host, b, k)  # noqa: E731
            cpu.append(median_time(host, max(3, repeats // 4)))
            if dict_trie is not None:
                host = lambda: dict_trie_step(dict_trie, x, prefixes, sc_host, b, k)  # noqa: E731
                cpu_dict.append(median_time(host, max(3, repeats // 4)))
        del dict_trie
        con_ms, cpu_ms, unc_ms = (1e3 * float(np.mean(x)) for x in (con, cpu, unc))
        dict_ms = 1e3 * float(np.mean(cpu_dict)) if cpu_dict else None
        key = jax.random.PRNGKey(1)

        def run():
            return trie_beam_search(constraint, RandomLogits(v), key, b, num_beams=k, max_new_tokens=n_len,
                                    vocab_size=v).tokens

        t0 = time.perf_counter()
        out = jax.block_until_ready(run())
        decode_compile = time.perf_counter() - t0
        decode_ms = 1e3 * median_time(run, max(3, repeats // 4))
        assert all(index.contains(np.asarray(out)[i, j].tolist()) for i in range(b) for j in range(k))
        row = dict(items=n, build_s=round(build_s, 2), bytes_per_item=round(index.nbytes / n, 1),
                   reference_bytes_per_item=round(reference_layout_bytes(index) / n, 1),
                   unconstrained_step_ms=round(unc_ms, 4), constrained_step_ms=round(con_ms, 4),
                   overhead_ms=round(con_ms - unc_ms, 4), cpu_trie_step_ms=round(cpu_ms, 3),
                   speedup_vs_cpu_trie=round(cpu_ms / con_ms, 1),
                   dict_trie_step_ms=None if dict_ms is None else round(dict_ms, 3),
                   speedup_vs_dict_trie=None if dict_ms is None else round(dict_ms / con_ms, 1),
                   model_free_decode_ms=round(decode_ms, 2),
                   step_compile_s=round(compile_s, 1), decode_compile_s=round(decode_compile - decode_ms / 1e3, 1),
                   per_depth_ms=[round(1e3 * x, 4) for x in con],
                   per_depth_unconstrained_ms=[round(1e3 * x, 4) for x in unc])
        if model_info is not None:
            row["overhead_pct_of_model_step"] = round(100 * (con_ms - unc_ms) / model_info["decode_step_ms"], 3)
            row.update(_model_decodes(cfg, params, constraint, b, k, n_len, max(2, repeats // 8)))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del index, constraint, item_arr
    _print_tables(rows, model_info)
    return dict(rows=rows, model=model_info, vocab=v, length=n_len, batch=b, beams=k)


def _model_decodes(cfg, params, constraint, b, k, n_len, repeats) -> dict:
    """Whole beam searches with the model: constrained against plain (same shapes, no EOS)."""
    from jaxdecode.beam import beam_search
    prompts = jnp.asarray(np.random.default_rng(2).integers(1, cfg.vocab_size, (b, 8)), jnp.int32)
    lens = jnp.full((b,), 8, jnp.int32)
    plain = lambda: beam_search(cfg, params, prompts, lens, max_new_tokens=n_len, num_beams=k).tokens  # noqa: E731
    con = lambda: beam_search(cfg, params, prompts, lens, max_new_tokens=n_len, num_beams=k,  # noqa: E731
                              constraint=constraint).tokens
    jax.block_until_ready(plain())
    jax.block_until_ready(con())
    return dict(model_beam_ms=round(1e3 * median_time(plain, repeats), 1),
                model_constrained_beam_ms=round(1e3 * median_time(con, repeats), 1))


def _print_tables(rows, model_info):
    print("\n| items | build (s) | bytes/item (ref. layout) | unconstrained step (ms) | constrained step (ms) "
          "| overhead (ms) | host CSR trie step (ms) | vs host CSR | dict trie step (ms) | vs dict trie "
          "| model-free decode (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dict_cells = ("n/a | n/a" if r["dict_trie_step_ms"] is None
                      else f"{r['dict_trie_step_ms']} | {r['speedup_vs_dict_trie']}x")
        print(f"| {r['items']:.0e} | {r['build_s']} | {r['bytes_per_item']} ({r['reference_bytes_per_item']}) | "
              f"{r['unconstrained_step_ms']} | {r['constrained_step_ms']} | {r['overhead_ms']} | "
              f"{r['cpu_trie_step_ms']} | {r['speedup_vs_cpu_trie']}x | {dict_cells} | {r['model_free_decode_ms']} |")
    print("\nPer-depth constrained step (ms), then the unconstrained one:")
    for r in rows:
        print(f"  {r['items']:.0e}: {r['per_depth_ms']} vs {r['per_depth_unconstrained_ms']}")
    if model_info is not None:
        print(f"\nModel: {model_info['model']}; one decode step of batch x beams rows: "
              f"{model_info['decode_step_ms']:.2f} ms")
        print("\n| items | overhead / model step | model beam search (ms) | model constrained beam search (ms) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['items']:.0e} | {r['overhead_pct_of_model_step']}% | {r['model_beam_ms']} | "
                  f"{r['model_constrained_beam_ms']} |")



# ----------------------------------------------------------------------------- the reference peer
def find_reference(arg: str | None) -> tuple[Path | None, str]:
    """(checkout of the reference or None, how it was found or why not)."""
    def ok(d):
        return d is not None and (Path(d) / "static_decoding" / "decoding_jax.py").exists()

    if arg:
        return (Path(arg), f"--reference {arg}") if ok(arg) else (None, f"--reference {arg} holds no "
                                                                       "static_decoding/decoding_jax.py")
    env = os.environ.get("STATIC_REFERENCE_DIR")
    if env:
        return (Path(env), f"STATIC_REFERENCE_DIR={env}") if ok(env) else (
            None, f"STATIC_REFERENCE_DIR={env} holds no static_decoding/decoding_jax.py")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxdecode" / "static-constraint-decoding"
    if ok(cache):
        return cache, f"cached clone {cache}"
    if shutil.which("git") is None:
        return None, "git is not installed"
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["git", "clone", "--depth", "1", "--quiet", REFERENCE_URL, str(cache)], check=True,
                       timeout=120, capture_output=True, env=dict(os.environ, GIT_TERMINAL_PROMPT="0"))
    except (subprocess.SubprocessError, OSError) as e:
        shutil.rmtree(cache, ignore_errors=True)
        return None, f"git clone {REFERENCE_URL} failed ({type(e).__name__})"
    return (cache, f"cloned into {cache}") if ok(cache) else (None, f"the clone in {cache} has no decoding_jax.py")


def load_reference(path: Path):
    """The reference's (sparse_transition_jax, build_static_index), imported from its checkout."""
    sys.path.insert(0, str(path))
    try:
        dec = importlib.import_module("static_decoding.decoding_jax")
        csr = importlib.import_module("static_decoding.csr_utils")
    finally:
        sys.path.remove(str(path))
    return dec.sparse_transition_jax, csr.build_static_index


def shared_logits(table, last, step):
    """The logits both decoders get: table f32[L, HASH_ROWS, V], last int[R] -> f32[R, V]."""
    return table[jnp.minimum(step, table.shape[0] - 1), (last.astype(jnp.int32) * 7919) % HASH_ROWS]


def jaxdecode_logits(table, tokens, step):
    """jaxdecode's logits_fn: tokens[R, N] are each beam's tokens so far (pad after)."""
    last = jnp.where(step == 0, START, tokens[:, jnp.maximum(step - 1, 0)])
    return shared_logits(table, last, step)


class ReferenceModel:
    """The reference harness' model convention: (input_ids[R, 1], key) -> (logits[R, 1, V], key'). The
    "key" is (table, step), so the model is a pure function of each beam's last token and the step."""

    def __call__(self, input_ids, key):
        table, step = key
        return shared_logits(table, input_ids[:, 0], step)[:, None, :], (table, step + 1)

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, ReferenceModel)


def _timed(fn, repeats: int) -> tuple[float, float, object]:
    """(first call seconds, median of `repeats` later calls, first output)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    return first, median_time(fn, repeats), out


def run_peer(reference: str | None = None, items: int = 100_000, vocab: int = 2048, length: int = 8,
             batch: int = 2, beams=(8, 70), repeats: int = 50, seed: int = 0) -> list:
    """The peer section (module docstring). Returns one row per beam width ([] when skipped)."""
    path, how = find_reference(reference)
    if path is None:
        print(f"peer: reference STATIC implementation not available ({how}); skipping the peer comparison. "
              f"Provide a checkout of {REFERENCE_URL} with --reference DIR or STATIC_REFERENCE_DIR=DIR.",
              flush=True)
        return []
    sparse_transition_jax, build_static_index = load_reference(path)
    print(f"peer: reference from {how}", flush=True)
    rng = np.random.default_rng(seed)
    sids = np.unique(rng.integers(0, vocab, size=(items, length), dtype=np.int32), axis=0)  # sorted, unique
    table = jnp.asarray(rng.normal(size=(length, HASH_ROWS, vocab)).astype(np.float32) * 2)

    t0 = time.perf_counter()
    p_csr, indptr, branches, s_mask, d_mask, d_states = build_static_index(sids, vocab, dense_lookup_layers=2)
    ref_build_s = time.perf_counter() - t0
    ref_arrays = [jnp.asarray(a) for a in (p_csr, indptr, s_mask, d_mask, d_states)]
    ref_bytes = sum(int(a.nbytes) for a in ref_arrays)
    t0 = time.perf_counter()
    index = build_index(sids, vocab)
    build_s = time.perf_counter() - t0
    constraint = index.constraint()
    print(json.dumps(dict(items=int(sids.shape[0]), jaxdecode_build_s=round(build_s, 3),
                          reference_build_s=round(ref_build_s, 3),
                          jaxdecode_bytes_per_item=round(index.nbytes / sids.shape[0], 1),
                          reference_bytes_per_item=round(ref_bytes / sids.shape[0], 1))), flush=True)
    from jaxdecode.constraints.search import _trie_beam_search
    rows = []
    for k in beams:
        def ref_call():
            return sparse_transition_jax(ReferenceModel(), (table, jnp.int32(0)), batch, k, k, START, length,
                                         vocab, branches, *ref_arrays, d_dense=2)

        def jd_call():
            return trie_beam_search(constraint, jaxdecode_logits, table, batch, num_beams=k,
                                    max_new_tokens=length, vocab_size=vocab).tokens

        prepared = constraint.prepare(vocab, (), length, batch)

        def jd_core():  # the jitted loop alone: no argument checks, no prepare()
            return _trie_beam_search(prepared, table, logits_fn=jaxdecode_logits, batch=batch, num_beams=k,
                                     max_new_tokens=length, length_penalty=1.0, eos_ids=(), vocab_size=vocab).tokens

        ref_first, ref_s, ref_out = _timed(ref_call, repeats)
        jd_first, jd_s, jd_out = _timed(jd_call, repeats)
        core_s = median_time(jd_core, repeats)
        # Interleave a second round so drift in machine load hits both sides alike.
        ref_s = min(ref_s, median_time(ref_call, repeats))
        jd_s = min(jd_s, median_time(jd_call, repeats))
        t0 = time.perf_counter()
        for _ in range(1000):
            constraint.prepare(vocab, (), length, batch)
        prepare_us = (time.perf_counter() - t0) * 1e3
        same = np.array_equal(np.asarray(ref_out), np.asarray(jd_out))
        row = dict(items=int(sids.shape[0]), vocab=vocab, length=length, batch=batch, beams=k,
                   reference_ms=round(ref_s * 1e3, 3), jaxdecode_ms=round(jd_s * 1e3, 3),
                   speed_ratio=round(ref_s / jd_s, 3), jaxdecode_core_ms=round(core_s * 1e3, 3),
                   prepare_us=round(prepare_us, 1),
                   reference_compile_s=round(ref_first - ref_s, 2), jaxdecode_compile_s=round(jd_first - jd_s, 2),
                   identical_beams=bool(same))
        print(json.dumps(row), flush=True)
        assert same, "jaxdecode and the reference returned different beams on the same logits"
        rows.append(row)
    print("\n| beams | reference (ms) | jaxdecode (ms) | ratio (ref / jd) | jd core (ms) | prepare (us) "
          "| compile ref / jd (s) | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['beams']} | {r['reference_ms']} | {r['jaxdecode_ms']} | {r['speed_ratio']}x | "
              f"{r['jaxdecode_core_ms']} | {r['prepare_us']} | {r['reference_compile_s']} / "
              f"{r['jaxdecode_compile_s']} | {r['identical_beams']} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("peer", "steps", "all"), default="all")
    ap.add_argument("--reference", default=None, help="checkout of " + REFERENCE_URL)
    ap.add_argument("--peer-items", type=float, default=1e5)
    ap.add_argument("--peer-beams", default="8,70", help="comma-separated beam widths of the peer section")
    ap.add_argument("--peer-repeats", type=int, default=50)
    ap.add_argument("--items", default="1e5,1e6,1e7", help="comma-separated item counts (steps section)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--length", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--beams", type=int, default=70, help="beam width of the steps section")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-model", action="store_true", help="skip the model timings (steps section)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--dict-trie-max", type=float, default=1e6,
                    help="largest item count for the nested-dict host trie baseline (memory)")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}", flush=True)
    out = {}
    if args.only in ("peer", "all"):
        out["peer"] = run_peer(args.reference, items=int(args.peer_items), vocab=args.vocab, length=args.length,
                               batch=args.batch, beams=[int(x) for x in args.peer_beams.split(",")],
                               repeats=args.peer_repeats)
    if args.only in ("steps", "all"):
        out["steps"] = run_benchmark(items=[int(float(x)) for x in args.items.split(",")], vocab=args.vocab,
                                     length=args.length, batch=args.batch, beams=args.beams,
                                     model=not args.no_model, repeats=args.repeats,
                                     dict_trie_max=int(args.dict_trie_max))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
