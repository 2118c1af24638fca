"""Every drafter on the embedded target, side by side in one run: tau, target calls per token, drafter
cost per step relative to a target step, tokens/s and the speedup over plain decoding.

    python benchmarks/bench_drafters.py [--prompts 4 --prompt-tokens 128 --new 96 --batch-sizes 1,4
                                         --temperatures 0,0.7 --only medusa,eagle3 --json FILE]

Prompts come from two sources no model or drafter trained on: held-out stdlib files (the embedded
corpus's held-out split) and Python source from outside the corpus (installed packages, see
_common.outside_prompts). Trained drafters are read from `<target>/../drafters/<kind>` (the shipped
ones) or `--drafters-root DIR/<kind>`; a kind without a directory is skipped and says so. Each
configuration is compiled once before it is timed; greedy rows check the output against plain greedy
token for token. Drafter cost = the median time of one `propose` call (jit, the batch's first state)
over the median time of one plain decode step at the same batch size.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import jax
import numpy as np
from _common import (add_param_dtype_arg, drafts_with_lm, load_target_and_draft, median_seconds, prompts_by_source,
                     source_names, timed, write_result)

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts, prefill
from jaxdecode.drafters import make_drafter
from jaxdecode.models import init_cache
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import DraftContext, feature_request, select_features, speculative_decode
from jaxdecode.verifiers import get_verifier

# (label, drafter name, tree, options). Trained kinds need their directory; the rest need nothing.
CONFIGS = [
    ("draft_lm chain:4", "draft_lm", "chain:4", {}),
    ("draft_lm eagle:6,4,24", "draft_lm", "eagle:depth=6,topk=4,total=24", {}),
    ("draft_lm (second draft) chain:4", "draft_lm", "chain:4", {"second_draft": True}),
    ("prompt_lookup chain:3", "prompt_lookup", "chain:3", {}),
    ("prompt_lookup chain:4", "prompt_lookup", "chain:4", {}),
    ("retrieval chain:4", "retrieval", "chain:4", {}),
    ("retrieval chain:8", "retrieval", "chain:8", {}),
    ("retrieval chain:8, no confidence cut", "retrieval", "chain:8", {"min_reach": 0.0}),
    ("retrieval chain:12", "retrieval", "chain:12", {}),
    ("token_recycling", "token_recycling", None, {}),
    ("medusa chain:4", "medusa", "chain:4", {}),
    ("medusa static:4,2,2,1", "medusa", "static:4,2,2,1", {}),
    ("hydra chain:4", "hydra", "chain:4", {}),
    ("hydra static:4,2,2,1", "hydra", "static:4,2,2,1", {}),
    ("eagle3 chain:5", "eagle3", "chain:5", {}),
    ("eagle3 eagle:6,4,24", "eagle3", "eagle:depth=6,topk=4,total=24", {}),
    ("eagle3 chain:8", "eagle3", "chain:8", {}),  # the block drafter's tree, for its tau comparison
    ("block chain:8", "block", "chain:8", {}),
    ("accept_head (eagle3 chain:8)", "accept_head", "chain:8", {}),
    ("swift chain:4", "swift", "chain:4", {}),
    ("del chain:4", "del", "chain:4", {}),
    ("kangaroo chain:6", "kangaroo", "chain:6", {}),
]
TRAINED = {"medusa", "hydra", "eagle3", "block", "accept_head", "kangaroo", "retrieval"}


def drafter_dir(name: str, target_dir: Path, root: str | None) -> Path | None:
    for base in ([Path(root)] if root else []) + [target_dir.parent / "drafters", target_dir / "drafters"]:
        if (base / name / "config.json").exists():
            return base / name
    return None


def propose_seconds(drafter, target, pt, pl, sampler, cache_len: int) -> float:
    """Median time of one jit-compiled `propose` from the state after the prompt."""
    fl = tuple(getattr(drafter, "feature_layers", ()) or ())
    if fl:
        cache = init_cache(target.config, pt.shape[0], cache_len)
        _, _, hidden = prefill(target.config, target.params, pt, pl - 1, cache,
                               return_layers=feature_request(fl), with_hidden=True)
        state = drafter.init(pt, pl, cache_len, jax.random.PRNGKey(0), features=select_features(hidden, fl))
    else:
        state = drafter.init(pt, pl, cache_len, jax.random.PRNGKey(0))
    hist = np.zeros((pt.shape[0], cache_len), np.int32)
    hist[:, :pt.shape[1]] = np.asarray(pt)
    ctx = DraftContext(history=jax.numpy.asarray(hist), hist_len=pl, key=jax.random.PRNGKey(1))
    step = jax.jit(lambda s, c: drafter.propose(s, c, sampler)[0].tokens)
    return median_seconds(lambda: jax.block_until_ready(step(state, ctx)), 10, warmup=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="draft model dir (default: the embedded draft)")
    ap.add_argument("--drafters-root", default=None, help="folder of <kind>/ trained drafter dirs")
    ap.add_argument("--second-draft", default=None,
                    help="another draft model dir (e.g. one distilled on-policy), measured beside --draft")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per source")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--sources", type=source_names, default="heldout,outside")
    ap.add_argument("--only", default=None, help="comma list of drafter names to run")
    ap.add_argument("--labels", default=None,
                    help="';'-separated configuration labels to run (as in the table, e.g. 'hydra chain:4;"
                         "retrieval chain:8'), for a short run; default: every configuration of --only")
    ap.add_argument("--repeats", type=int, default=1)
    add_param_dtype_arg(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # checked before any model loads: a typo fails at once
    labels = [x.strip() for x in args.labels.split(";") if x.strip()] if args.labels else None
    known = [c[0] for c in CONFIGS]
    if labels and set(labels) - set(known):
        ap.error(f"--labels: unknown {sorted(set(labels) - set(known))}; known: {known}")

    target_dir, target, draft = load_target_and_draft(args)
    second = (jaxdecode.load(args.second_draft, dtype="float32", param_dtype=args.param_dtype)
              if args.second_draft else None)
    cfg = target.config
    sources = prompts_by_source(args.sources, target.tokenizer, args.prompts, args.prompt_tokens)
    only = set(args.only.split(",")) if args.only else None
    print(f"target {cfg.num_parameters() / 1e6:.1f} M; {args.prompts} prompts x {args.prompt_tokens} tokens "
          f"per source ({', '.join(sources)}), {args.new} new; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, {os.cpu_count()} cores, {platform.machine()}", flush=True)
    rows, skipped = [], []
    for t in (float(x) for x in args.temperatures.split(",")):
        sampler = SamplerConfig(temperature=t)
        key = jax.random.PRNGKey(0)
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            for source, prompts in sources.items():
                batches = [pad_prompts(prompts[i:i + bs]) for i in range(0, len(prompts), bs)]
                n_tok = args.new * len(prompts)

                def run(fn):
                    outs, secs, calls, steps = [], 0.0, 0, 0
                    for pt, pl in batches:
                        (toks, c, s), sec = timed(lambda: fn(pt, pl), args.repeats)
                        outs.append(np.asarray(toks))
                        secs, calls, steps = secs + sec, calls + c, steps + s
                    return outs, secs, calls, steps

                def plain(pt, pl):
                    out = decode(cfg, target.params, pt, pl, max_new_tokens=args.new, sampler=sampler, key=key,
                                 method="greedy" if t == 0 else "sample")
                    jax.block_until_ready(out.tokens)
                    return out.tokens, int(out.stats["target_calls"]), args.new

                base, base_s, _, _ = run(plain)
                step_s = base_s / (args.new * len(batches))  # one plain decode step at this batch size
                head = dict(temperature=t, batch=bs, source=source)
                rows.append(dict(head, method="plain decoding", tau=1.0, calls_per_token=1.0,
                                 drafter_cost=0.0, tok_s=n_tok / base_s, speedup=1.0, equal=True))
                print(f"\nT={t} batch {bs} {source}: plain {n_tok / base_s:.1f} tok/s", flush=True)
                for label, name, tree, kw in CONFIGS:
                    if (only and name not in only) or (labels and label not in labels):
                        continue
                    opts = dict(kw)
                    use_draft = draft
                    if opts.pop("second_draft", False):
                        if second is None:
                            skipped.append(f"{label}: no --second-draft")
                            continue
                        use_draft = second
                    if name in TRAINED:
                        d = drafter_dir(name, target_dir, args.drafters_root)
                        if d is None:
                            skipped.append(f"{label}: no trained directory")
                            continue
                        opts["drafter_dir"] = str(d)
                    try:
                        lm = use_draft if drafts_with_lm(name, target, opts.get("drafter_dir")) else None
                        drafter = make_drafter(name, target, draft=lm, tree=tree, temperature=t, **opts)
                        verifier = get_verifier("greedy" if t == 0 else _sampling_verifier(drafter))
                    except (ImportError, ValueError, KeyError) as e:
                        skipped.append(f"{label} (T={t}): {e}")
                        continue

                    def spec(pt, pl):
                        out = speculative_decode(cfg, target.params, drafter, pt, pl, max_new_tokens=args.new,
                                                 verifier=verifier, sampler=sampler, key=key)
                        jax.block_until_ready(out.tokens)
                        return out.tokens, int(out.stats["target_calls"]), int(np.sum(out.stats["verify_calls"]))

                    outs, secs, calls, steps = run(spec)
                    pt, pl = batches[0]
                    cost = propose_seconds(drafter, target, pt, pl, sampler, cache_len=512) / step_s
                    same = all(np.array_equal(a, b) for a, b in zip(outs, base))
                    row = dict(head, method=f"{label} / {verifier.name}", tau=n_tok / max(steps, 1),
                               calls_per_token=calls / n_tok, drafter_cost=cost, tok_s=n_tok / secs,
                               speedup=base_s / secs, equal=same)
                    rows.append(row)
                    print(f"  {row['method']:44s} tau {row['tau']:.2f}  calls/tok {row['calls_per_token']:.3f}  "
                          f"draft cost {cost:.2f}  {row['tok_s']:.1f} tok/s  {row['speedup']:.2f}x  "
                          f"{('same tokens' if same else 'DIFFERS') if t == 0 else 'sampled'}", flush=True)
    print("\n| T | batch | prompts | method | tau | target calls / token | drafter cost / target step | "
          "tok/s | speedup | greedy == plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eq = ("yes" if r["equal"] else "NO") if r["temperature"] == 0 else "n/a"
        print(f"| {r['temperature']} | {r['batch']} | {r['source']} | {r['method']} | {r['tau']:.2f} | "
              f"{r['calls_per_token']:.3f} | {r['drafter_cost']:.2f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {eq} |")
    for s in dict.fromkeys(skipped):
        print(f"skipped: {s}")
    write_result(dict(jax=jax.__version__, platform=jax.devices()[0].platform, cpu_count=os.cpu_count(),
                      args=vars(args), rows=rows, skipped=list(dict.fromkeys(skipped))), args.json)
    return all(r["equal"] for r in rows if r["temperature"] == 0)


def _sampling_verifier(drafter) -> str:
    from jaxdecode.decoders import DEFAULT_VERIFIER
    return DEFAULT_VERIFIER[drafter.child_rule]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
