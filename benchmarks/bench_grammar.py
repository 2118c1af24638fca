"""Grammar constraints (jaxdecode.constraints.grammar): compile time, per-step mask cost, decode overhead.

Grammars: a JSON grammar in Lark (lark's common terminals, %ignore WS), arithmetic expressions, a
recursive JSON schema (a tree: children items $ref "#"), and the same JSON grammar in GBNF; the
tokenizer is the embedded target's (byte-level BPE, V = 4096).

Sections (--sections, default all):
  compile   backend ("device" / "llguidance"), states, token classes, popping tokens per state (their
            outcome looked up per (state, stack top)), tokens simulated byte by byte per step (those that
            pop twice or more), compile seconds (no disk cache; the first grammar includes JAX compilation of
            the token-level precompute) / llguidance matcher build seconds.
  mask      per-step mask cost along a text of the grammar (µs per step: mask + advance), batch 1 and 16:
            the device mask (jitted) vs llguidance's host mask (compute_bitmask per row) and, when installed,
            xgrammar's (GrammarMatcher.fill_next_token_bitmask per row, the grammar as EBNF / schema).
  overhead  a greedy decode step of the embedded target with and without the grammar constraint, batch 1
            and 16 (timed round robin), plus `any_text` (a regex every text matches: plain's own text, so
            the constraint machinery alone): wall time / steps run (the longest row's new tokens; rows that end early under the
            grammar make the constrained figure pessimistic, so mean new tokens are reported too).

    python benchmarks/bench_grammar.py --quick          # small sizes: checks it runs
    python benchmarks/bench_grammar.py --out grammar.json
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import interleaved_medians, median_seconds, write_result

JSON_LARK = r"""
start: value
?value: object | array | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
object: "{" [pair ("," pair)*] "}"
pair: ESCAPED_STRING ":" value
array: "[" [value ("," value)*] "]"
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+/
"""
GBNF = r"""
root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" [a-z ]* "\""
number ::= "-"? [0-9]+
ws ::= [ ]?
"""
TREE = {"type": "object", "properties": {"value": {"type": "integer"}, "tag": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["value", "children"]}
TEXTS = {
    "json_lark": '{"a": [1, 2, {"b": [true, null, "x y"]}], "c": {"d": {"e": [[-3], []]}}}',
    "arith": "(1 + 2) * (3 - (4 / 5)) + -6 * ((7 + 8) * 9) - 10",
    "tree_schema": '{"value": 1, "children": [{"value": 2, "tag": "x", "children": [{"value": 3, "children": []}]}, '
                   '{"value": 4, "children": []}]}',
    "json_gbnf": '{"a": [1, 2, {"b": [true, null, "x y"]}], "c": {"d": {"e": [[-3], []]}}}',
}


def _compile(name, tok, vocab_size, cache=True):
    from jaxdecode.constraints.grammar import compile_grammar
    from jaxdecode.constraints.grammar_schema import compile_schema_grammar

    if name == "tree_schema":
        return compile_schema_grammar(TREE, tok, vocab_size=vocab_size, eos_ids=(0,), cache=cache)
    text = {"json_lark": JSON_LARK, "arith": ARITH, "json_gbnf": GBNF}[name]
    return compile_grammar(text, tok, vocab_size=vocab_size, eos_ids=(0,), cache=cache)


def section_compile(names, tok, vocab_size):
    out = {}
    for name in names:
        t0 = time.perf_counter()
        g = _compile(name, tok, vocab_size, cache=False)  # compile time without the disk cache
        sec = time.perf_counter() - t0
        t0 = time.perf_counter()
        g.matcher()
        llg = time.perf_counter() - t0
        row = {"backend": g.backend, "reason": g.reason, "compile_s": sec, "llguidance_matcher_s": llg}
        if g.backend == "device":
            row.update(states=int(g.tables.kind.shape[0]), classes=int(g.code.shape[1]),
                       popping_per_state=int(g.pops.shape[1]),
                       simulated_per_step=int(g.pairs.multi.shape[1]), pushes_per_byte=int(g.tables.push.shape[-1]))
        out[name] = row
    return out


def _xgrammar_matchers(name, tok, vocab_size, rows):
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    comp = xgr.GrammarCompiler(info)
    if name == "tree_schema":
        import json
        cg = comp.compile_json_schema(json.dumps(TREE), any_whitespace=False)
    elif name == "json_gbnf":
        cg = comp.compile_grammar(GBNF)
    else:
        return None  # Lark text: xgrammar reads EBNF / schemas only
    return xgr, [xgr.GrammarMatcher(cg) for _ in range(rows)]


def section_mask(names, tok, vocab_size, batches, repeats):
    from jaxdecode.constraints.grammar import llg_mask

    out = {}
    for name in names:
        g = _compile(name, tok, vocab_size)
        ids = tok.encode(TEXTS[name])
        res = {"tokens": len(ids)}
        for b in batches:
            if g.backend == "device":
                c = g.constraint().prepare(vocab_size, (0,), len(ids) + 1, b)
                seq = jnp.asarray(np.repeat(np.asarray(ids, np.int32)[:, None], b, axis=1))

                @jax.jit
                def run(seq, c=c, b=b):
                    def step(st, t):
                        return c.advance(st, t), c.allowed(st).sum()
                    return jax.lax.scan(step, c.init(b), seq)[1]

                run(seq).block_until_ready()
                sec = median_seconds(lambda seq=seq, run=run: run(seq).block_until_ready(), repeats)
                res[f"device_us_b{b}"] = sec / len(ids) * 1e6

            def llg(b=b, g=g, ids=ids):
                ms = [g.matcher() for _ in range(b)]
                t0 = time.perf_counter()
                for t in ids:
                    for m in ms:
                        llg_mask(m, vocab_size)
                        m.consume_token(t)
                return time.perf_counter() - t0
            res[f"llguidance_us_b{b}"] = min(llg() for _ in range(repeats)) / len(ids) * 1e6
            xg = _xgrammar_matchers(name, tok, vocab_size, b)
            if xg is not None:
                xgr, _ = xg
                bitmask = xgr.allocate_token_bitmask(b, vocab_size)

                def xrun(b=b, bitmask=bitmask, name=name, ids=ids):
                    ms = _xgrammar_matchers(name, tok, vocab_size, b)[1]
                    t0 = time.perf_counter()
                    for t in ids:
                        for i, m in enumerate(ms):
                            m.fill_next_token_bitmask(bitmask, i)
                            m.accept_token(t)
                    return time.perf_counter() - t0
                res[f"xgrammar_us_b{b}"] = min(xrun() for _ in range(repeats)) / len(ids) * 1e6
        out[name] = res
    return out


def section_overhead(names, model, batches, new_tokens, repeats):
    from jaxdecode.autoregressive import decode

    prompt = model.encode("data = ")
    out = {}
    from jaxdecode.constraints.automaton import compile_regex

    constraints = {name: _compile(name, model.tokenizer, model.config.vocab_size).constraint() for name in names}
    # A constraint that allows every text: the same text as plain, so its overhead is the constraint's
    # machinery alone (the grammars' texts differ from plain's, and this CPU's step time depends on the text).
    constraints["any_text"] = compile_regex(r"[\s\S]*", model.tokenizer, vocab_size=model.config.vocab_size,
                                            eos_ids=(0,)).constraint()
    for b in batches:
        toks = jnp.asarray([prompt] * b, jnp.int32)
        lens = jnp.full((b,), len(prompt), jnp.int32)

        def run(c, toks=toks, lens=lens):
            o = decode(model.config, model.params, toks, lens, max_new_tokens=new_tokens, eos_ids=(0,),
                       constraint=c, method="greedy")
            o.tokens.block_until_ready()
            return o
        configs = {"plain": None, **constraints}
        steps = {k: int(np.max(np.asarray(run(c).lengths))) for k, c in configs.items()}  # compiles too
        mean_new = {k: float(np.mean(np.asarray(run(c).lengths))) for k, c in configs.items()}
        # round robin, so load drift during the run hits plain and constrained alike
        secs = interleaved_medians({k: (lambda c=c: run(c)) for k, c in configs.items()}, repeats)
        t_base = secs["plain"] / steps["plain"]
        out[f"plain_ms_per_step_b{b}"] = t_base * 1e3
        out[f"plain_mean_new_tokens_b{b}"] = mean_new["plain"]
        for name in constraints:
            t = secs[name] / steps[name]
            out[f"{name}_ms_per_step_b{b}"] = t * 1e3
            out[f"{name}_overhead_b{b}"] = t / t_base - 1
            out[f"{name}_mean_new_tokens_b{b}"] = mean_new[name]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="compile,mask,overhead")
    ap.add_argument("--grammars", default="json_lark,arith,tree_schema,json_gbnf")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = "1,2", 8, 1
    import jaxdecode

    model = jaxdecode.load()
    names = args.grammars.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    sections = set(args.sections.split(","))
    result = {"bench": "grammar", "backend": jax.default_backend(), "vocab": model.config.vocab_size}
    if "compile" in sections:
        result["compile"] = section_compile(names, model.tokenizer, model.config.vocab_size)
    if "mask" in sections:
        result["mask"] = section_mask(names, model.tokenizer, model.config.vocab_size, batches, args.repeats)
    if "overhead" in sections:
        result["overhead"] = section_overhead(names, model, batches, args.new_tokens, args.repeats)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
