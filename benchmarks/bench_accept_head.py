"""The acceptance head against the best fixed draft length of the drafter it wraps, on the embedded target.

    python benchmarks/bench_accept_head.py [--prompts 8 --prompt-tokens 128 --new 128 --ks 1,2,3,4,5,6,7,8
                                            --source heldout|outside --head-k 8 --thresholds 0.3,0.5,0.7,0.8,0.9
                                            --temperatures 0,0.7
                                            --head DIR [--inner-dir DIR] | [--inner KIND] [--target-proj P]
                                            --head-out DIR --train-prompts 64 --steps 400 --fixed-catch-up
                                            --processes N --json FILE]

Batch 1, held-out prompts: stdlib files of the embedded corpus's held-out split, or with --source outside
Python source from outside the corpus (_common.outside_prompts). The inner drafter is
the one the head was trained over (its config's `inner`: the embedded draft LM, or a trained kind such
as eagle3 or retrieval, from --inner-dir or the target's shipped drafters). For each temperature: plain
decoding (the baseline), the inner drafter's chain:K for every K in --ks (a drafter's own cut, such as
retrieval's min_reach, off; with it on as one more row), and the acceptance head over chain:--head-k
at each threshold h, with the inner drafter's level loop stopped at the cut ("stop") and, with
--tail-only, only the verification shrunk ("tail"); with --fixed-catch-up, every chain and head row once
more with the inner drafter catching up in one block of K + 1 rows, as before its catch-up was sized to
what was accepted (draft_lm.catch_up_widths). Every configuration is compiled first, then all are
timed round robin (--repeats rounds, the median per configuration), so load drift hits them alike. Each
row: tau, verification calls, tokens/s, speedup over plain, and (greedy) whether the output equals plain
greedy token for token. The summary compares the best head row, and the row at the head's saved
threshold, with the best fixed K (the issue's goal: >= 10% more tokens/s), and prices ideal length rules
with this run's own step times (training.accept_head.stopping_ceilings over a label run of chain:--head-k
on the timed prompts; needs 1 and --head-k in --ks): a perfect head under the head's rule, a rule that
knows the next verdict before drafting, and that rule with a plain step where nothing would be kept.
Each is reported against the best fixed length priced the same way and against it as timed; only the
second is fair (a fixed chain shorter than --head-k commits more tokens per step when run than when priced
from the long chain's steps).

Without --head, a head is trained first over --inner (default the draft LM; training/accept_head.py:
label runs of chain:--head-k at T=0 and T=0.7 on --train-prompts windows of the corpus's train split,
then BCE) and saved to --head-out (default: a temporary directory); its held-out BCE and ECE are
printed. Compile time is excluded.

--processes N runs the whole measurement in N fresh processes, one after another (the head trained once,
first), and adds their mean: on a noisy CPU one compiled program's speed moves by 5-10% from one process
to the next, so a single process decides a 10% comparison by chance. The summary compares the mean
tokens/s of the head at its saved threshold, and of the best head row, with the fixed length whose mean is
highest (the per-process ratios are listed too).
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import (PROMPT_SOURCES, add_param_dtype_arg, heldout_prompts, interleaved_medians, load_target_and_draft,
                     write_result)

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import DraftLM, load_drafter, make_drafter
from jaxdecode.drafters.accept_head import AcceptHeadDrafter, without_own_cut
from jaxdecode.drafters.builders import ChainBuilder
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import speculative_decode
from jaxdecode.verifiers import get_verifier


def train_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 1) -> list[list[int]]:
    """Windows of the train split (never the held-out files the rows below are measured on)."""
    import sysconfig

    from _common import _windows
    from jaxdecode.training.corpus import iter_texts
    from jaxdecode.training.recipe import HELD_OUT_FRACTION
    texts = [t for t in iter_texts([sysconfig.get_paths()["stdlib"]], held_out_fraction=HELD_OUT_FRACTION,
                                   split="train") if len(t) > 4000]
    return _windows(texts, tokenizer, n, prompt_tokens, seed)


FIXED_CATCH_UP = " [catch-up block K+1]"  # row-name suffix of --fixed-catch-up rows


def run_rows(target, drafter, prompts, new: int, sampler, verifier, eos, seed: int):
    """Decode each prompt alone (batch 1): (tokens list, total new tokens, verify calls)."""
    outs, calls, n = [], 0, 0
    for i, p in enumerate(prompts):
        toks, lens = pad_prompts([p])
        if drafter is None:
            o = decode(target.config, target.params, toks, lens, max_new_tokens=new, sampler=sampler,
                       method="greedy" if sampler.is_greedy else "sample", eos_ids=eos,
                       key=jax.random.PRNGKey(seed + i))
        else:
            o = speculative_decode(target.config, target.params, drafter, toks, lens, max_new_tokens=new,
                                   verifier=verifier, sampler=sampler, eos_ids=eos, key=jax.random.PRNGKey(seed + i))
            calls += int(np.asarray(o.stats["verify_calls"]).sum())
        length = int(np.asarray(o.lengths)[0])
        outs.append(np.asarray(o.tokens)[0, :length].tolist())
        n += length
    return outs, n, calls


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--source", choices=tuple(PROMPT_SOURCES), default="heldout",
                    help="timed prompts from held-out stdlib files, or from Python source outside the corpus")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--head-k", type=int, default=8)
    ap.add_argument("--thresholds", default="0.3,0.5,0.7,0.8,0.9")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--tail-only", action="store_true", help="also time the head without the early stop")
    ap.add_argument("--fixed-catch-up", action="store_true", help="also time every chain and head row with the "
                    "inner drafter catching up in one fixed block of max_depth + 1 (as before 2026-12-03)")
    ap.add_argument("--repeats", type=int, default=3, help="timing rounds (round robin over configurations)")
    ap.add_argument("--head", default=None, help="a trained accept_head directory (default: train one)")
    ap.add_argument("--inner-dir", default=None, help="the trained inner drafter's directory (head over a "
                    "trained kind; default: the target's shipped one)")
    ap.add_argument("--inner", default="draft_lm", help="the drafter a head trained here wraps (draft_lm, or a "
                    "trained kind: eagle3, retrieval, ...)")
    ap.add_argument("--target-proj", type=int, default=0, help="a head trained here also reads the target's "
                    "bonus-slot state, projected to this many dims (AcceptHeadConfig.target_proj)")
    ap.add_argument("--head-out", default=None, help="where the trained head goes (default: a temp dir)")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--train-new", type=int, default=96)
    ap.add_argument("--steps", type=int, default=400)
    add_param_dtype_arg(ap)
    ap.add_argument("--processes", type=int, default=1, help="repeat the measurement in this many fresh "
                    "processes and report their mean (the head is trained once, first)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.processes > 1:
        return across_processes(args, sys.argv[1:] if argv is None else list(argv))

    _, target, draft = load_target_and_draft(args)
    eos = tuple(target.config.eos_token_ids or ())
    prompts = PROMPT_SOURCES[args.source](target.tokenizer, args.prompts, args.prompt_tokens)
    result = {"machine": platform.platform(), "backend": jax.default_backend(), "prompts": len(prompts),
              "source": args.source,
              "new": args.new, "rows": [], "head": {}}

    head_dir = args.head
    if head_dir is None:
        from jaxdecode.training.accept_head import train_accept_head
        from jaxdecode.training.trainer import TrainConfig
        head_dir = args.head_out or tempfile.mkdtemp(prefix="accept_head_")
        t0 = time.perf_counter()
        tc = TrainConfig(steps=args.steps, learning_rate=3e-3, warmup_steps=min(20, args.steps - 1),
                         log_every=50, eval_every=0, checkpoint_every=0, progress=False, data_parallel=1)
        held = heldout_prompts(target.tokenizer, 16, args.prompt_tokens, seed=7)  # not the timed prompts
        report = train_accept_head(target, draft if args.inner == "draft_lm" else None, out_dir=head_dir,
                                      inner=args.inner, inner_dir=args.inner_dir, train_config=tc, k=args.head_k,
                                      config_overrides={"target_proj": args.target_proj},
                                      train_prompts=train_prompts(target.tokenizer, args.train_prompts,
                                                                  args.prompt_tokens),
                                      heldout_prompts=held, new_tokens=args.train_new).report
        result["head"] = {"trained_seconds": time.perf_counter() - t0, "heldout": report, "dir": head_dir}
        print(f"head trained in {result['head']['trained_seconds']:.0f}s -> {head_dir}; held-out {report}",
              file=sys.stderr)
    head = load_drafter(head_dir, target)

    inner_kind = head.cfg.inner
    result["inner"] = inner_kind

    def inner_chain(k: int, rule: str, own_cut: bool = False, fixed_catch_up: bool = False):
        if inner_kind == "draft_lm":
            d = DraftLM(params=draft.params, config=draft.config, builder=ChainBuilder(k, rule))
        else:
            d = make_drafter(inner_kind, target, tree=ChainBuilder(k, rule), drafter_dir=args.inner_dir)
            d = d if own_cut else without_own_cut(d)
        return dataclasses.replace(d, catch_up_sizes=(k + 1,)) if fixed_catch_up else d

    for temp in [float(t) for t in args.temperatures.split(",")]:
        sampler = SamplerConfig(temperature=temp)
        rule = "argmax" if temp == 0 else "sample"
        inner = inner_chain(args.head_k, rule)
        verifier = get_verifier("greedy" if temp == 0 else "point_mass" if inner.child_rule == "point" else "chain")
        # --fixed-catch-up: the same rows with the catch-up in one block of K + 1 (drafters that have one)
        variants = [(False, "")] + ([(True, FIXED_CATCH_UP)] if args.fixed_catch_up
                                    and hasattr(inner, "catch_up_sizes") else [])
        configs = {"plain": None}
        for fixed_cu, suffix in variants:
            configs.update({f"{inner_kind} chain:{k}{suffix}": inner_chain(k, rule, fixed_catch_up=fixed_cu)
                            for k in (int(x) for x in args.ks.split(","))})
        own = inner_chain(args.head_k, rule, own_cut=True)
        if getattr(own, "min_reach", 0) > 0:
            configs[f"{inner_kind} chain:{args.head_k} own cut"] = own
        # the sweep, plus the threshold saved with the head (train_accept_head's speed_estimate choice)
        for h in sorted({float(x) for x in args.thresholds.split(",")} | {float(head.cfg.threshold)}):
            for stop in ((True, False) if args.tail_only else (True,)):
                for fixed_cu, suffix in variants:
                    configs[f"accept_head chain:{args.head_k} h={h:g} {'stop' if stop else 'tail'}{suffix}"] = (
                        AcceptHeadDrafter.wrap(inner_chain(args.head_k, rule, fixed_catch_up=fixed_cu), head.params,
                                               head.cfg, h, stop))
        outs = {name: run_rows(target, d, prompts, args.new, sampler, verifier, eos, 0)  # compile + outputs
                for name, d in configs.items()}
        secs = interleaved_medians({name: (lambda d=d: run_rows(target, d, prompts, args.new, sampler, verifier,
                                                                eos, 0)) for name, d in configs.items()},
                                   args.repeats)
        ref, base_n, _ = outs["plain"]
        base_tps = base_n / secs["plain"]
        print(f"T={temp:g} plain: {base_tps:.1f} tok/s", file=sys.stderr)
        result["rows"].append({"T": temp, "config": "plain", "tokens_per_s": base_tps, "speedup": 1.0})
        for name in configs:
            if name == "plain":
                continue
            toks, n, calls = outs[name]
            row = {"T": temp, "config": name, "tau": n / max(calls, 1), "verify_calls": calls,
                   "tokens_per_s": n / secs[name], "speedup": (n / secs[name]) / base_tps}
            if temp == 0:
                row["equals_greedy"] = toks == ref
            result["rows"].append(row)
            print(f"T={temp:g} {name}: tau {row['tau']:.2f} {row['tokens_per_s']:.1f} tok/s "
                  f"x{row['speedup']:.2f}" + (f" equal={row['equals_greedy']}" if temp == 0 else ""),
                  file=sys.stderr)
        rows = [r for r in result["rows"] if r["T"] == temp and not r["config"].endswith(FIXED_CATCH_UP)]
        fixed = max((r for r in rows if r["config"].startswith(f"{inner_kind} chain:")
                     and not r["config"].endswith("own cut")),
                    key=lambda r: r["tokens_per_s"])
        best = max((r for r in rows if r["config"].startswith("accept_head")), key=lambda r: r["tokens_per_s"])
        saved = next(r for r in rows if r["config"].startswith(f"accept_head chain:{args.head_k} "
                                                                f"h={float(head.cfg.threshold):g} stop"))
        ceilings = priced_ceilings(target, inner, head, configs, prompts, args, sampler, verifier, eos, secs, outs,
                                   inner_kind)
        result.setdefault("summary", {})[f"T={temp:g}"] = {
            "saved_threshold": head.cfg.threshold, "saved_head_tps": saved["tokens_per_s"],
            "saved_over_fixed": saved["tokens_per_s"] / fixed["tokens_per_s"],
            "best_fixed": fixed["config"], "best_fixed_tps": fixed["tokens_per_s"], "best_head": best["config"],
            "best_head_tps": best["tokens_per_s"], "head_over_fixed": best["tokens_per_s"] / fixed["tokens_per_s"],
            **{f"own_cut_{k}": r[k] for r in rows if r["config"].endswith("own cut")
               for k in ("tokens_per_s", "speedup")}, "ceilings": ceilings}
    write_result(result, args.json)


def _without_option(argv: list, name: str) -> list:
    """argv without option `name` and its value (`--name V` or `--name=V`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def across_processes(args, argv: list) -> None:
    """--processes N: train the head once if needed, then run this script N times (each a fresh process
    with --head and --json), and summarise the mean tokens/s per configuration and temperature."""
    import json
    import os
    import statistics
    import subprocess
    argv = _without_option(_without_option(argv, "--processes"), "--json")
    work = tempfile.mkdtemp(prefix="bench_accept_head_")
    if args.head is None:  # train once (one short timing pass), then every process times that head
        head_dir = args.head_out or os.path.join(work, "head")
        subprocess.run([sys.executable, __file__, *argv, "--head-out", head_dir, "--prompts", "1", "--new", "8",
                        "--ks", "1", "--thresholds", "0", "--temperatures", "0", "--repeats", "1"], check=True)
        argv = _without_option(argv, "--head-out") + ["--head", head_dir]
    runs = []
    for i in range(args.processes):
        out = os.path.join(work, f"run{i}.json")
        subprocess.run([sys.executable, __file__, *argv, "--json", out], check=True)
        with open(out) as f:
            runs.append(json.load(f))
        print(f"process {i + 1}/{args.processes} done", file=sys.stderr)
    result = {"processes": args.processes, "runs": runs, "mean": {}}
    for key, summary in runs[0].get("summary", {}).items():
        temp = float(key.split("=")[1])
        names = [r["config"] for r in runs[0]["rows"] if r["T"] == temp]
        tps = {n: [next(r["tokens_per_s"] for r in run["rows"] if r["T"] == temp and r["config"] == n)
                   for run in runs] for n in names}
        mean = {n: statistics.mean(v) for n, v in tps.items()}
        inner = runs[0]["inner"]
        fixed = max((n for n in names
                     if n.startswith(f"{inner} chain:") and not n.endswith(("own cut", FIXED_CATCH_UP))), key=mean.get)
        heads = [n for n in names if n.startswith("accept_head") and not n.endswith(FIXED_CATCH_UP)]
        best = max(heads, key=mean.get)
        saved = next(n for n in heads if f" h={float(summary['saved_threshold']):g} stop" in n)
        result["mean"][key] = {
            "tokens_per_s": mean, "best_fixed": fixed, "best_head": best, "saved_head": saved,
            "saved_over_fixed": mean[saved] / mean[fixed], "head_over_fixed": mean[best] / mean[fixed],
            "saved_over_fixed_per_process": [a / b for a, b in zip(tps[saved], tps[fixed])],
            # the saved head's own cuts priced, over the best fixed length as timed in the same process
            "priced_saved_over_fixed": [run["summary"][key]["ceilings"]["over_timed_fixed"].get(saved, float("nan"))
                                        for run in runs if run["summary"][key]["ceilings"]]}
        m = result["mean"][key]
        print(f"{key} over {args.processes} processes, mean tok/s: "
              + ", ".join(f"{n} {v:.1f}" for n, v in mean.items()), file=sys.stderr)
        print(f"{key}: saved head ({saved}) / best fixed ({fixed}) = {m['saved_over_fixed']:.3f}; best head "
              f"({best}) / best fixed = {m['head_over_fixed']:.3f}; per process "
              + ", ".join(f"{r:.3f}" for r in m["saved_over_fixed_per_process"]), file=sys.stderr)
    write_result(result, args.json)


def priced_ceilings(target, inner, head, configs, prompts, args, sampler, verifier, eos, secs, outs, inner_kind):
    """training.accept_head.stopping_ceilings for this run: a label run of the head's chain on the timed
    prompts (the accepted length of every step), priced with the step times just measured (each fixed
    chain's seconds per verification, plain decoding's per token), and each timed head row's own cuts on
    those steps priced the same way. Printed as ratios to the best fixed length under the same pricing and
    to the best fixed length as timed (`over_timed_fixed`, the fair one: see below); {} when --ks lacks 1
    or --head-k."""
    from jaxdecode.drafters.accept_head import keep_mask
    from jaxdecode.training.accept_head import collect_labels, label_logits, stopping_ceilings
    steps = {}
    for name in secs:
        if name.startswith(f"{inner_kind} chain:") and not name.endswith(("own cut", FIXED_CATCH_UP)):
            steps[int(name.rsplit(":", 1)[1])] = secs[name] / max(outs[name][2], 1)
    if 1 not in steps or args.head_k not in steps:
        print(f"(no stopping ceilings: --ks must include 1 and --head-k {args.head_k})", file=sys.stderr)
        return {}
    labels = collect_labels(target.config, target.params, inner, prompts, verifier=verifier, sampler=sampler,
                            max_new_tokens=args.new, batch_size=len(prompts), eos_ids=eos,
                            states=head.cfg.drafter_proj > 0)
    accepted = (labels["label"] * labels["mask"]).sum(1).astype(int)
    logits = jnp.asarray(label_logits(head.params, head.cfg, labels))
    cuts = {name: np.asarray(keep_mask(logits, d.threshold)).sum(1) for name, d in configs.items()
            if name.startswith("accept_head") and name.endswith("stop")}
    c = stopping_ceilings(accepted, steps, secs["plain"] / outs["plain"][1], args.head_k, rules=cuts)
    best = max(c["fixed"].values())
    # Priced from the chain:K label run's steps, a fixed chain of k < K commits fewer tokens per step than
    # it does when run (2026-12-05: 4-10% fewer), so rules priced against priced fixed lengths look better
    # than they are; "over_timed_fixed" compares each priced rule with the best fixed length as timed.
    timed_best = max(outs[f"{inner_kind} chain:{k}"][1] / secs[f"{inner_kind} chain:{k}"] for k in steps)
    ratios = {name: c[name] / best for name in ("head_rule", "foresight", "foresight_and_skip")}
    over_timed = {name: tps / timed_best for name, tps in
                  [*c["rules"].items(), *((n, c[n]) for n in ("head_rule", "foresight", "foresight_and_skip"))]}
    for name, tps in c["rules"].items():
        print(f"T={sampler.temperature:g} {name}: priced {tps / best:.3f}x of the best fixed length priced alike, "
              f"{tps / timed_best:.3f}x of it timed; timed {outs[name][1] / secs[name] / timed_best:.3f}x",
              file=sys.stderr)
    print(f"T={sampler.temperature:g} ceilings over the best fixed length, priced with this run's step times "
          f"({len(accepted)} steps, mean accepted {accepted.mean():.2f}), against the fixed lengths priced alike "
          "/ timed: " + ", ".join(f"{name} {r:.3f}x / {over_timed[name]:.3f}x" for name, r in ratios.items())
          + f"; plain / best fixed {c['plain'] / best:.3f}x", file=sys.stderr)
    return {**c, "over_best_fixed": ratios, "over_timed_fixed": over_timed, "timed_best_fixed": timed_best,
            "steps": int(len(accepted)), "mean_accepted": float(accepted.mean())}


if __name__ == "__main__":
    main()
