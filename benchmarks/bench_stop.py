"""Stop strings (jaxdecode.stop): host compile time of the token automaton, and the decode overhead of the
in-loop check.

Sections:
  compile   building the tables for 10 short stop strings: the embedded tokenizer (V = 4096, cold, then
            from the in-memory cache) and synthetic byte vocabularies of V = 32k and 150k (random printable
            tokens, lengths ~ 1 + Exp(5), capped at 60 bytes). Goal: well under 1 s at 32k, a few s at 150k.
  overhead  greedy decoding of the embedded target with and without stop strings that never occur
            (EOS off, so every row runs every step), batch 1 and 16; plain greedy and greedy speculative
            (prompt lookup, chain of 4, adaptive off). Reported: ms per call and the ratio (goal <= 1.03).

    python benchmarks/bench_stop.py --quick          # small sizes (checks it runs)
    python benchmarks/bench_stop.py --out stop.json  # the full run
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

from _common import median_seconds, write_result

STOPS = ["\n\n", "def ", "class ", "</s>", "###", "Human:", "```", "\nUser:", "END", "  \n"]
NEVER = ["\x00\x01never\x02"]  # bytes no prompt or output here holds: the check runs, never fires


def synthetic_vocab(v: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = [bytes(rng.randrange(32, 127) for _ in range(min(int(rng.expovariate(1 / 5)) + 1, 60)))
           for _ in range(v)]
    out[0] = None  # a special token
    return out


def bench_compile(quick: bool) -> dict:
    import jaxdecode
    from jaxdecode import stop
    res = {}
    model = jaxdecode.load()
    t = time.perf_counter()
    stop.stop_tables(model.tokenizer, STOPS, model.config.vocab_size)
    res["embedded_cold_s"] = time.perf_counter() - t
    t = time.perf_counter()
    stop.stop_tables(model.tokenizer, STOPS, model.config.vocab_size)
    res["embedded_cached_s"] = time.perf_counter() - t
    for v in ((32_000,) if quick else (32_000, 150_000)):
        vocab = synthetic_vocab(v)
        t = time.perf_counter()
        tables = stop.compile_stops(vocab, STOPS, v)
        res[f"synthetic_{v}_s"] = time.perf_counter() - t
        res[f"synthetic_{v}_states_classes"] = list(tables.next.shape)
    return res


def bench_overhead(quick: bool) -> dict:
    import jaxdecode
    from jaxdecode import verifiers
    from jaxdecode.autoregressive import decode, pad_prompts
    from jaxdecode.drafters import make_drafter
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.stop import stop_constraint

    model = jaxdecode.load()
    n_new = 16 if quick else 128
    repeats = 2 if quick else 7
    prompt = model.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    c = stop_constraint(model, NEVER)
    drafter = make_drafter("prompt_lookup", model, tree="chain:4")
    greedy = verifiers.get_verifier("greedy")
    res = {}
    for batch in ((1,) if quick else (1, 16)):
        toks, lens = pad_prompts([prompt] * batch)

        def plain(constraint, toks=toks, lens=lens):
            out = decode(model.config, model.params, toks, lens, max_new_tokens=n_new, eos_ids=(), method="greedy",
                         constraint=constraint)
            np.asarray(out.tokens)

        def spec(constraint, toks=toks, lens=lens):
            out = speculative_decode(model.config, model.params, drafter, toks, lens, max_new_tokens=n_new,
                                     verifier=greedy, eos_ids=(), constraint=constraint)
            np.asarray(out.tokens)

        for name, fn in (("greedy", plain), ("speculative", spec)):
            base = median_seconds(lambda fn=fn: fn(None), repeats, warmup=1)
            with_stop = median_seconds(lambda fn=fn: fn(c), repeats, warmup=1)
            res[f"{name}_b{batch}"] = dict(ms=round(1e3 * base, 2), ms_stop=round(1e3 * with_stop, 2),
                                           ratio=round(with_stop / base, 3))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="compile,overhead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"bench": "stop", "quick": args.quick}
    sections = args.sections.split(",")
    if "compile" in sections:
        result["compile"] = bench_compile(args.quick)
    if "overhead" in sections:
        result["overhead"] = bench_overhead(args.quick)
    write_result(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
