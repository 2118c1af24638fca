"""Does `method="speculative"` pay at every batch size? Plain decoding vs the default speculative
method (adaptive), the same with adaptive=False, and trained drafters, side by side in one run.

    python benchmarks/bench_adaptive.py [--batch-sizes 1,4,16 --temperatures 0,0.7 --max-new-tokens 128
                                         --prompts 16 --sources heldout,outside --drafter medusa,hydra,eagle3
                                         --json-out FILE]
    python benchmarks/bench_adaptive.py --quick       # tiny sizes: a smoke run of a couple of minutes

Everything goes through `jaxdecode.generate` as a user calls it, on the embedded target (float32, or with
`--param-dtype bfloat16` its weight matrices in bf16, computing in float32) and
prompts no model trained on (held-out stdlib files; `--sources heldout,outside` adds installed packages
outside the corpus). Per (temperature, batch size, source) the rows are:

- plain decoding (`greedy`, or `sample` at T > 0): the baseline, the ratio's denominator;
- `speculative (default)`: method="speculative" with no drafter / tree / verifier options (with
  `--draft DIR` the draft model is passed too, as a user with one would);
- `speculative adaptive=False`: the same, fixed configuration (only once generate has the option);
- `speculative drafter=KIND`: each trained drafter shipped in `<target>/drafters/KIND`, its own default
  tree (or `--drafter-tree`), adaptive when generate has the option;
- `--row LABEL=JSON` (repeatable): method="speculative" with the generate options of JSON, e.g.
  `--row 'chain12={"tree": "chain:12", "drafter_options": {"min_reach": 0.15}}'`.

Each configuration is called once untimed first (compile, and a cost-table calibration if one runs),
then every batch is timed round robin over the configurations, --repeats rounds, the median of each
(so load drifting during the run hits every row alike). Rows generate exactly --max-new-tokens tokens (no EOS,
unless --eos) so every method does the same work. Columns: tokens/s, ratio to plain (with its spread:
the lowest and highest ratio of one round, every batch's timing of that round summed; a round keeps
the outliers that the per-batch medians drop, so the ratio may lie just outside it), tau (new tokens
per verification call), and at T=0 whether the output equals plain greedy token for token. Exit status
1 when a greedy row differs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import jax
import numpy as np
from _common import (add_param_dtype_arg, finish_args, interleaved_times, prompts_by_source, source_names,
                     write_result)

import jaxdecode
from jaxdecode.api import embedded_model_path

FULL = dict(prompts=16, prompt_tokens=128, max_new_tokens=128, batch_sizes="1,4,16", temperatures="0,0.7")
QUICK = dict(prompts=4, prompt_tokens=32, max_new_tokens=16, batch_sizes="1,4", temperatures="0,0.7")
PLAIN = "plain"  # the baseline's key among a cell's configurations
KNOWN_STATS = {"new_tokens", "seconds", "compile_seconds", "nonfinite_logits", "target_calls", "tau",
               "verify_calls", "accept_hist", "accept_rate_by_depth"}


def has_option(name: str, method: str = "speculative") -> bool:
    """Whether generate(method=...) takes option `name` (so the script runs before and after it lands)."""
    from jaxdecode.options import OPTIONS
    return name in OPTIONS and OPTIONS[name].takes(method)


def cost_cache_dir() -> str:
    """Where the engine keeps its measured cost tables (reused across runs), for the record."""
    try:
        from jaxdecode.costmodel import default_cache_dir
    except ImportError:  # an engine without cost tables
        return "none"
    return str(default_cache_dir() / "costs")


def run_configs(model, batches: list, kws: dict, repeats: int, skipped: list) -> dict:
    """{name: result} of generate(model, batch, **kws[name]) over every batch. Each configuration is
    called once untimed first (compile, calibration; one the engine refuses lands in `skipped`), then
    every batch is timed round robin over the configurations, `repeats` rounds (the median of each):
    drift in the machine's load hits every configuration alike, where timing one configuration after
    another made a cell's plain baseline move by up to 30%. A result holds outputs (token lists, prompt
    order), seconds (summed over batches), warmup_seconds, tau and calls per token over all rows, and
    the stats this script does not know: scalars averaged over rows and `*_hist` lists summed (extra),
    every list stat per batch (batch_stats)."""
    import time
    warm = {}
    for name, kw in kws.items():
        t0 = time.perf_counter()
        try:
            jaxdecode.generate(model, batches[0], **kw)
        except (ValueError, KeyError) as e:  # e.g. an option pair the engine refuses
            skipped.append(f"{name}: {type(e).__name__}: {e}")
            print(f"  skip {name}: {e}", flush=True)
            continue
        warm[name] = time.perf_counter() - t0
    rounds_n = max(repeats, 1)
    acc = {name: dict(outs=[], seconds=0.0, round_seconds=np.zeros(rounds_n), warmup_seconds=w, new=0, verify=0,
                      calls=0, extra={}, batch_stats={}) for name, w in warm.items()}
    for batch in batches:
        last = {}

        def call(name, b=batch):
            last[name] = jaxdecode.generate(model, b, **kws[name])
        rounds = interleaved_times({name: (lambda n=name: call(n)) for name in warm}, rounds_n)
        for name, a in acc.items():
            res = last[name]
            a["seconds"] += float(np.median(rounds[name]))
            a["round_seconds"] += rounds[name]  # every batch's r-th timing, summed
            a["outs"] += [r.tokens for r in res]
            a["new"] += sum(r.stats["new_tokens"] for r in res)
            # verify_calls is per row (the steps the row took part in); plain decoding: one call per token
            a["verify"] += sum(int(r.stats.get("verify_calls", r.stats["new_tokens"])) for r in res)
            a["calls"] += int(res[0].batch_stats["target_calls"]) * len(res)  # one batched call serves every row
            for k, v in {**res[0].batch_stats, **res[0].stats}.items():  # stats a newer engine adds (the policy's)
                if k in KNOWN_STATS:
                    continue
                if isinstance(v, (int, float, bool)):  # per row: their mean over rows
                    a["extra"].setdefault(k, []).extend(float({**r.batch_stats, **r.stats}[k]) for r in res)
                else:  # lists (per batch or per row): kept per batch
                    a["batch_stats"].setdefault(k, []).append(v)
    out = {}
    for name, a in acc.items():
        extra = {k: float(np.mean(v)) for k, v in a["extra"].items()}
        for k, v in a["batch_stats"].items():  # histograms (e.g. verify widths chosen) summed over batches
            if k.endswith("_hist") and len({len(x) for x in v}) == 1:
                extra[k] = np.sum(np.asarray(v, float), axis=0).astype(int).tolist()
        out[name] = dict(outs=a["outs"], seconds=a["seconds"], round_seconds=a["round_seconds"].tolist(),
                         warmup_seconds=a["warmup_seconds"],
                         new_tokens=a["new"], tau=a["new"] / max(a["verify"], 1),
                         calls_per_token=a["calls"] / max(a["new"], 1), extra=extra, batch_stats=a["batch_stats"])
    return out


def configs(target_dir: Path, target, draft, kinds: list[str], drafter_tree, skipped: list) -> list:
    """(label, generate options) of the speculative rows."""
    adaptive = has_option("adaptive")
    base = dict(method="speculative") | ({"draft": draft} if draft is not None else {})
    rows = [("speculative (default" + (": adaptive)" if adaptive else ")"), base)]
    if adaptive:
        rows.append(("speculative adaptive=False", base | {"adaptive": False}))
    else:
        skipped.append("speculative adaptive=False: this jaxdecode's generate has no `adaptive` option yet")
    for kind in kinds:
        d = target_dir / "drafters" / kind
        if not (d / "config.json").exists():
            skipped.append(f"drafter={kind}: no trained drafter in {d}")
            continue
        # loaded once, so the timed calls measure decoding, not reading the weights
        kw = dict(method="speculative", drafter=jaxdecode.load_drafter(d, target))
        if drafter_tree:
            kw["tree"] = drafter_tree
        if adaptive:
            kw["adaptive"] = True
        label = f"speculative drafter={kind}" + (f" tree={drafter_tree}" if drafter_tree else "")
        rows.append((label + (" (adaptive)" if adaptive else ""), kw))
    return rows


def extra_row(ap, spec: str) -> tuple:
    """(label, generate options) of a --row LABEL=JSON."""
    label, sep, text = spec.partition("=")
    try:
        kw = json.loads(text) if sep and label else None
    except json.JSONDecodeError as e:
        ap.error(f"--row {spec!r}: the options after '=' are not JSON ({e})")
    if not isinstance(kw, dict):
        ap.error(f"--row {spec!r}: give LABEL={{...}}, a label and a JSON object of generate options")
    return label, dict(method="speculative") | kw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded target)")
    ap.add_argument("--draft", default=None,
                    help="draft model dir passed to the default speculative rows (default: none)")
    ap.add_argument("--drafter", default="medusa,hydra,eagle3",
                    help="comma list of trained drafter kinds (from <target>/drafters/KIND); '' = none")
    ap.add_argument("--drafter-tree", default=None, help="tree= for the trained drafters (default: their own)")
    ap.add_argument("--row", action="append", default=[], metavar="LABEL=JSON",
                    help="an extra speculative row: method='speculative' with these generate options "
                         "(a JSON object; repeatable)")
    ap.add_argument("--prompts", type=int, default=None, help=f"prompts per source ({FULL['prompts']})")
    ap.add_argument("--prompt-tokens", type=int, default=None, help=f"({FULL['prompt_tokens']})")
    ap.add_argument("--max-new-tokens", type=int, default=None, help=f"({FULL['max_new_tokens']})")
    ap.add_argument("--batch-sizes", default=None, help=f"({FULL['batch_sizes']})")
    ap.add_argument("--temperatures", default=None, help=f"({FULL['temperatures']})")
    ap.add_argument("--sources", type=source_names, default="heldout", help="heldout and/or outside, comma separated")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds per batch, round robin over the rows (median; default 3)")
    add_param_dtype_arg(ap)
    ap.add_argument("--eos", action="store_true", help="stop rows at the model's EOS (default: fixed length)")
    ap.add_argument("--cost-cache", default=None,
                    help="directory of the measured cost tables (sets JAXDECODE_CACHE_DIR; a fresh directory "
                         "makes the adaptive rows calibrate on this machine now, not reuse tables measured "
                         "under other load)")
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes for a smoke run: {QUICK}")
    ap.add_argument("--json-out", default=None, help="write all rows as JSON here")
    args = ap.parse_args(argv)
    finish_args(args, QUICK if args.quick else FULL)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    bad = [b for b in batch_sizes if b < 1 or args.prompts % b]
    if bad:
        ap.error(f"--prompts {args.prompts} must be a multiple of every batch size (not of {bad}), so every "
                 f"batch has the same shape and no timed call compiles")

    target_dir = Path(args.target or embedded_model_path("target"))
    target = jaxdecode.load(target_dir, dtype="float32", param_dtype=args.param_dtype)
    draft = jaxdecode.load(args.draft, dtype="float32", param_dtype=args.param_dtype) if args.draft else None
    sources = prompts_by_source(args.sources, target.tokenizer, args.prompts, args.prompt_tokens)
    skipped: list[str] = []
    kinds = [k for k in args.drafter.split(",") if k]
    spec_rows = configs(target_dir, target, draft, kinds, args.drafter_tree, skipped)
    spec_rows += [extra_row(ap, r) for r in args.row]
    # A row's draft model given as a path is loaded once here, as --draft is: generate would read it on
    # every timed call (~40 ms, 8% of a 128-token decode of the embedded target at batch 1).
    loaded = {str(Path(args.draft).resolve()): draft} if draft is not None else {}
    for _, kw in spec_rows:
        if isinstance(kw.get("draft"), str):
            path = str(Path(kw["draft"]).resolve())
            if path not in loaded:
                loaded[path] = jaxdecode.load(path, dtype="float32", param_dtype=args.param_dtype)
            kw["draft"] = loaded[path]
    common = dict(max_new_tokens=args.max_new_tokens) | ({} if args.eos else {"eos_ids": []})
    print(f"target {target.config.num_parameters() / 1e6:.1f} M float32; {args.prompts} prompts x "
          f"{args.prompt_tokens} tokens per source ({', '.join(sources)}), {args.max_new_tokens} new; "
          f"adaptive option: {has_option('adaptive')} (cost tables: {cost_cache_dir()}); jax {jax.__version__} "
          f"on {jax.devices()[0].platform}, {os.cpu_count()} cores, {platform.machine()}", flush=True)

    rows = []
    for t in temperatures:
        plain_kw = (dict(method="greedy") if t == 0 else dict(method="sample", temperature=t, seed=0)) | common
        sampling = {} if t == 0 else dict(temperature=t, seed=0)
        for bs in batch_sizes:
            for source, prompts in sources.items():
                batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
                head = dict(temperature=t, batch=bs, source=source)
                results = run_configs(target, batches, {PLAIN: plain_kw} | {label: kw | sampling | common
                                                                            for label, kw in spec_rows},
                                      args.repeats, skipped)
                plain = results.pop(PLAIN)
                n_tok = plain["new_tokens"]
                print(f"\nT={t} batch {bs} {source}: plain {n_tok / plain['seconds']:.1f} tok/s "
                      f"(compile {plain['warmup_seconds']:.1f} s)", flush=True)
                rows.append(dict(head, method=f"plain ({plain_kw['method']})", tok_s=n_tok / plain["seconds"],
                                 ratio=1.0, tau=1.0, calls_per_token=plain["calls_per_token"],
                                 equal=True if t == 0 else None, compile_seconds=plain["warmup_seconds"]))
                for label, m in results.items():
                    same = m["outs"] == plain["outs"] if t == 0 else None  # sampled rows: other draws
                    # the ratio within each round (every batch's r-th timing of both rows, summed): its
                    # spread over rounds is this machine's noise on the ratio
                    by_round = sorted(p / s for p, s in zip(plain["round_seconds"], m["round_seconds"]))
                    row = dict(head, method=label, tok_s=m["new_tokens"] / m["seconds"],
                               ratio=plain["seconds"] / m["seconds"], ratio_rounds=by_round, tau=m["tau"],
                               calls_per_token=m["calls_per_token"], equal=same,
                               compile_seconds=m["warmup_seconds"], stats=m["extra"],
                               batch_stats=m["batch_stats"])
                    rows.append(row)
                    print(f"  {label:44s} tau {row['tau']:.2f}  {row['tok_s']:.1f} tok/s  {row['ratio']:.2f}x plain "
                          f"(rounds {by_round[0]:.2f}-{by_round[-1]:.2f})  "
                          f"{('same tokens' if same else 'DIFFERS') if t == 0 else 'sampled'}"
                          f"{'  ' + str(m['extra']) if m['extra'] else ''}"
                          f"{''.join(f'  {k} {v[0]}' for k, v in m['batch_stats'].items() if k.endswith('_widths'))}",
                          flush=True)
                # each cell compiles its own programs: release them, or a grid of cells runs out of memory
                # maps in XLA:CPU (README, "Many configurations in one process")
                jax.clear_caches()

    print_table(rows, skipped)
    write_result(dict(jax=jax.__version__, platform=jax.devices()[0].platform, cpu_count=os.cpu_count(),
                      adaptive_option=has_option("adaptive"), cost_tables=cost_cache_dir(), args=vars(args),
                      rows=rows, skipped=list(dict.fromkeys(skipped))), args.json_out)
    return all(r["equal"] for r in rows if r["temperature"] == 0)


def print_table(rows: list, skipped: list) -> None:
    print("\n| T | batch | prompts | method | tok/s | vs plain (rounds: min-max) | tau | greedy == plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        eq = ("yes" if r["equal"] else "NO") if r["temperature"] == 0 else "n/a"
        spread = f" ({r['ratio_rounds'][0]:.2f}-{r['ratio_rounds'][-1]:.2f})" if r.get("ratio_rounds") else ""
        print(f"| {r['temperature']} | {r['batch']} | {r['source']} | {r['method']} | {r['tok_s']:.1f} | "
              f"{r['ratio']:.2f}x{spread} | {r['tau']:.2f} | {eq} |")
    best = {}
    for r in rows:  # the best trained drafter of each (T, batch, prompts)
        if "drafter=" in r["method"]:
            k = (r["temperature"], r["batch"], r["source"])
            if k not in best or r["ratio"] > best[k]["ratio"]:
                best[k] = r
    for (t, bs, src), r in best.items():
        print(f"best trained drafter at T={t}, batch {bs}, {src}: {r['method']} {r['ratio']:.2f}x (tau {r['tau']:.2f})")
    for s in dict.fromkeys(skipped):
        print(f"skipped: {s}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
