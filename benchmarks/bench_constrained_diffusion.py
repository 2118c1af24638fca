"""Regex / JSON-schema / grammar constraints in diffusion decoding (jaxdecode.diffusion, `constraint=`) with
the shipped dLLM: the fraction of answers that fully match, with and without the constraint, and what the
constraint costs in forwards and time.

    python benchmarks/bench_constrained_diffusion.py                         # load('dllm'), the default regex
    python benchmarks/bench_constrained_diffusion.py --regex '[0-9]{1,4}(, [0-9]{1,4}){0,5}'
    python benchmarks/bench_constrained_diffusion.py --schema schema.json --answer-length 48
    python benchmarks/bench_constrained_diffusion.py --prompts 4 --rules greedy1 --answer-length 16   # smoke
    python benchmarks/bench_constrained_diffusion.py --grammar arith      # a grammar (arith | json, Lark)
    python benchmarks/bench_constrained_diffusion.py --grammar arith --suffix ')*2'   # infilling before a suffix

Prompts are held-out standard-library windows (the split the embedded models never trained on) ending in
a blank line, so a `def` line is a natural next text for the default pattern. Per (rule, constrained)
one JSON line: valid (fraction of rows whose answer up to EOS fully matches the pattern), unfinished
(rows cut off by max_forwards), nfe and tokens_per_forward (means over rows), seconds (wall time of all
batches, compilation excluded: one untimed batch first), and the automaton's size (states, classes).
With --grammar (a pushdown automaton, jaxdecode.constraints.grammar; commits kept while a witness walk
through them exists) valid means lark parses the answer up to EOS (+ the --suffix text when infilling); constrained rows that run out of slots before the grammar accepts
are not valid (unmatched: their fraction, from stats["constraint_unmatched"]).
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax
import numpy as np
from _common import decode_in_batches, heldout_prompts, rows
from bench_dllm_tasks import _rule

from jaxdecode import diffusion as D

PATTERN = r"def [a-z_][a-z0-9_]{0,23}\((self)?(, [a-z_][a-z0-9_]{0,11}){0,3}\):"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dllm", help="a diffusion checkpoint directory (default: the embedded dLLM)")
    ap.add_argument("--regex", default=PATTERN, help="the pattern each answer must match in full")
    ap.add_argument("--schema", help="a JSON schema file instead of --regex")
    ap.add_argument("--grammar", choices=("arith", "json"), help="a Lark grammar instead of --regex (bench_grammar's "
                    "arithmetic expressions or JSON)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--answer-length", type=int, default=32, help="answer slots (an EOS ends an answer early)")
    ap.add_argument("--block-length", type=int, help="semi-autoregressive block of slots (default: the answer)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rules", default="greedy1,threshold,llada:4")
    ap.add_argument("--suffix", default=None, help="infilling: this text follows every answer (the constrained "
                    "text is answer + suffix)")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jaxdecode
    from jaxdecode.constraints.automaton import compile_json_schema, compile_regex, schema_to_regex
    model = jaxdecode.load(args.model, dtype=args.dtype)
    config, params, tok = model.config, model.params, model.tokenizer
    eos = tuple(int(e) for e in config.eos_token_ids)
    if args.grammar:
        import lark
        from bench_grammar import ARITH, JSON_LARK

        from jaxdecode.constraints.grammar import compile_grammar
        text = {"arith": ARITH, "json": JSON_LARK}[args.grammar]
        parser = lark.Lark(text, parser="earley")
        t0 = time.perf_counter()
        auto = compile_grammar(text, tok, vocab_size=config.vocab_size, eos_ids=eos)
        if auto.backend != "device":
            raise SystemExit(f"the grammar compiled to {auto.backend} ({auto.reason}); diffusion takes device grammars")
    elif args.schema:
        pattern = schema_to_regex(open(args.schema).read())
        t0 = time.perf_counter()
        auto = compile_json_schema(open(args.schema).read(), tok, vocab_size=config.vocab_size, eos_ids=eos)
    else:
        pattern = args.regex
        t0 = time.perf_counter()
        auto = compile_regex(pattern, tok, vocab_size=config.vocab_size, eos_ids=eos)
    compile_s = time.perf_counter() - t0
    sep = tok.encode("\n\n")
    prompts = np.asarray([w + sep for w in heldout_prompts(tok, args.prompts, args.prompt_tokens, args.seed)],
                         np.int32)
    n, batch = len(prompts), min(args.batch, len(prompts))
    infill = {}
    if args.suffix:
        sfx = tok.encode(args.suffix)
        infill = dict(suffix_tokens=np.tile(np.asarray(sfx, np.int32), (batch, 1)),
                      suffix_lengths=np.full(batch, len(sfx), np.int32))
    if args.grammar:
        def matches(text):
            try:
                return bool(parser.parse(text))
            except lark.exceptions.LarkError:
                return False
        size = {"states": int(auto.tables.kind.shape[0]), "classes": int(auto.code.shape[1])}
    else:
        regex = re.compile(pattern, re.DOTALL)
        matches = lambda text: regex.fullmatch(text) is not None
        size = {"states": auto.num_states, "classes": auto.num_classes}

    def decode_all(rule, constraint):
        outs, seconds = decode_in_batches(lambda idx: D.diffusion_decode(
            config, params, prompts[idx], np.full(batch, prompts.shape[1], np.int32),
            answer_length=args.answer_length, block_length=args.block_length, rule=rule, eos_ids=eos,
            key=jax.random.PRNGKey(args.seed), constraint=constraint, **infill), n, batch)
        cat = lambda f: rows(outs, n, f)
        unmatched = cat(lambda o: o.stats.get("constraint_unmatched", o.stats["unfinished"]))
        return (cat(lambda o: o.tokens), cat(lambda o: o.lengths), cat(lambda o: o.stats["nfe"]),
                cat(lambda o: o.stats["tokens_per_forward"]), cat(lambda o: o.stats["unfinished"]), unmatched,
                seconds)

    for spec in args.rules.split(","):
        rule = _rule(spec, args.threshold, None)
        for constrained in (False, True):
            tokens, lengths, nfe, tpf, unfinished, unmatched, seconds = decode_all(
                rule, auto.constraint() if constrained else None)
            valid = []
            for row, ln, unf in zip(tokens, lengths, unfinished):
                body = [int(t) for t in row[:ln] if int(t) not in eos]
                valid.append(not unf and matches(tok.decode(body) + (args.suffix or "")))
            print(json.dumps({"rule": spec, "constrained": constrained, "prompts": n,
                              "constraint": f"grammar:{args.grammar}" if args.grammar else
                              ("schema" if args.schema else "regex"),
                              "answer_length": args.answer_length, "suffix": args.suffix,
                              "valid": float(np.mean(valid)),
                              "unfinished": float(np.mean(unfinished)), "nfe": float(nfe.mean()),
                              **({"unmatched": float(np.mean(unmatched))} if constrained else {}),
                              "tokens_per_forward": float(tpf.mean()), "seconds": seconds,
                              **size, "automaton_compile_s": compile_s,
                              "example": tok.decode([int(t) for t in tokens[0, :lengths[0]] if int(t) not in eos])}))


if __name__ == "__main__":
    main()
