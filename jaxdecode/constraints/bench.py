"""Constrained-decoding benchmark (benchmarks/bench_constrained.py and `jaxdecode index bench`).

For each item count N (random items of `length` tokens over `vocab` ids, the STATIC setting: V 2048,
L 8, batch 2, beam 70):
  * index build time and bytes per item (and the reference layout's bytes, computed from the same trie:
    [token, next_state] int32 pairs + int32 indptr over non-leaf states + two V x V tables);
  * one beam step's selection on random logits, jit-compiled, per item depth and averaged over the L
    depths (the first step on the batch's rows, the others on R = batch x beams rows): unconstrained
    (log_softmax + top-k over beams x V) against constrained (TrieConstraint.candidates + top-k over
    beams x C), the difference being the overhead;
  * two host (CPU) trie steps in the same process: (1) per beam, its row in the host CSR arrays of the
    same index, that row's log-probs into a mask, top-k on the host; (2) the `prefix_allowed_tokens_fn`
    pattern of generative-retrieval code: per beam, walk its prefix from the root of a nested-dict trie
    and mask the allowed tokens (built up to `dict_trie_max` items: ~1.5 GB of Python objects at 1e6);
  * whole decodes: the model-free constrained beam search (random logits), and, with `model`, one
    decode step of the target model and constrained vs plain beam search with it.
Times are medians of `repeats` calls after a warm-up call (compile excluded, reported apart).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.index import build_index
from jaxdecode.constraints.search import trie_beam_search


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
    """The constrained beam step's selection, as beam search runs it: the constraint's candidates (per
    group of k beams from the running scores; per row on the first step's b prompt rows), then the
    top-k over beams x C."""
    grouped = logits.shape[0] == b * k
    c = constraint.candidates(state, logits, k, scores=run_scores if grouped else None)
    width = c.tokens.shape[1]
    cand = (run_scores[:, None] + c.logprobs).reshape(b, -1)
    top, idx = jax.lax.top_k(cand, k)
    tok = jnp.take_along_axis(c.tokens.reshape(b, -1), idx, axis=1)
    nxt = jnp.take_along_axis(c.next[0].reshape(b, -1), idx, axis=1)
    return top, idx // width, tok, nxt


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
                  model: bool = True, repeats: int = 20, seed: int = 0, json_out: str | None = None,
                  dict_trie_max: int = 1_000_000) -> list:
    rng = np.random.default_rng(seed)
    b, k, v, n_len = batch, beams, vocab, length
    r = b * k
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}; V={v}, L={n_len}, "
          f"batch={b}, beams={k} ({r} rows)", flush=True)
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
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(rows=rows, model=model_info, vocab=v, length=n_len, batch=b, beams=k), f, indent=2)
    return rows


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


__all__ = ["run_benchmark", "cpu_trie_step", "dict_trie_step", "build_dict_trie", "reference_layout_bytes"]
