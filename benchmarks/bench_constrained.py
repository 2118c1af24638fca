"""Constrained decoding (STATIC) benchmark: the constrained beam step against the unconstrained one and
a CPU trie, whole constrained decodes, index build time and bytes per item, at growing item counts.

    python benchmarks/bench_constrained.py [--items 1e5,1e6,1e7 --vocab 2048 --length 8 --batch 2 --beams 70]

The setting defaults to the STATIC reference's (V 2048, L 8, batch 2, beam 70). The model for the
"overhead / decode step" column is the embedded target model when shipped, else a random ~12 M llama
(d 384, 6 layers, vocab 4096). Prints JSON lines while it runs and markdown tables at the end.
The same benchmark runs as `jaxdecode index bench`.
"""
from __future__ import annotations

import argparse

from jaxdecode.constraints.bench import run_benchmark


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", default="1e5,1e6,1e7", help="comma-separated item counts")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--length", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--beams", type=int, default=70)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-model", action="store_true", help="skip the model timings")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--dict-trie-max", type=float, default=1e6,
                    help="largest item count for the nested-dict host trie baseline (memory)")
    args = ap.parse_args()
    run_benchmark(items=[int(float(x)) for x in args.items.split(",")], vocab=args.vocab, length=args.length,
                  batch=args.batch, beams=args.beams, model=not args.no_model, repeats=args.repeats,
                  json_out=args.json, dict_trie_max=int(args.dict_trie_max))


if __name__ == "__main__":
    main()
