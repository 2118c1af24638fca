"""jaxdecode speculative decoding vs transformers assisted generation on the same weights (greedy, batch 1).

    python benchmarks/bench_vs_hf_assisted.py [--prompts 8 --max-new-tokens 128 --json-out FILE]
    python benchmarks/bench_vs_hf_assisted.py --quick      # tiny sizes: a smoke run

The embedded target and draft, float32 in both libraries (transformers: AutoModelForCausalLM on torch
CPU, or `--torch-device cuda` on a GPU machine; it supports assisted generation at batch 1 only, so every row here is batch 1). Same held-out
prompts, same max_new_tokens, no EOS (every row generates exactly that many tokens).

transformers rows come from bench_speculative.bench_transformers: plain greedy `generate`, assisted
generation (`assistant_model=` the draft) and prompt lookup. jaxdecode rows go through `generate` as a
user calls it (bench_adaptive.run_configs, round robin): plain greedy, `method="speculative"` with the draft model
(drafter draft_lm, its default tree; adaptive by default once generate has the option, and with
adaptive=False beside it), and `method="speculative"` with no options at all. Each is compiled / warmed
up before it is timed. Columns: tokens/s, ratio to the same library's plain greedy (side by side in this
run), ratio to transformers assisted generation, tau, and whether the output equals jaxdecode greedy.
Exit status 1 when a jaxdecode row differs from jaxdecode greedy.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
from _common import finish_args, heldout_prompts, write_result
from bench_adaptive import cost_cache_dir, has_option, run_configs
from bench_speculative import bench_transformers

import jaxdecode
from jaxdecode.api import embedded_model_path

FULL = dict(prompts=8, prompt_tokens=128, max_new_tokens=128)
QUICK = dict(prompts=2, prompt_tokens=32, max_new_tokens=16)


def assistant_schedule(draft_dir) -> str:
    """How transformers sizes the assistant's drafts (its own adaptive rule), for the record."""
    import transformers as tf
    try:
        g = tf.GenerationConfig.from_pretrained(draft_dir)
    except OSError:  # no generation_config.json: the library defaults
        g = tf.GenerationConfig()
    # unset fields take the library's defaults at generate time (transformers >= 5 keeps them apart)
    defaults = getattr(tf.GenerationConfig, "_get_default_generation_params", dict)()
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return ", ".join(f"{n}={getattr(g, n, None) if getattr(g, n, None) is not None else defaults.get(n)}"
                     for n in names)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="draft model dir (default: the embedded draft)")
    ap.add_argument("--prompts", type=int, default=None, help=f"held-out prompts ({FULL['prompts']})")
    ap.add_argument("--prompt-tokens", type=int, default=None, help=f"({FULL['prompt_tokens']})")
    ap.add_argument("--max-new-tokens", type=int, default=None, help=f"({FULL['max_new_tokens']})")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per prompt (median)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch intra-op threads (default: every core, as jax uses; on a loaded machine 1 is "
                         "far faster, since torch's threads spin waiting for each other)")
    ap.add_argument("--torch-device", default="cpu",
                    help="where transformers runs: cpu, or cuda on a GPU machine (jaxdecode uses JAX's default)")
    ap.add_argument("--cost-cache", default=None, help="directory of the measured cost tables (sets "
                    "JAXDECODE_CACHE_DIR; a fresh one calibrates on this machine now)")
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes for a smoke run: {QUICK}")
    ap.add_argument("--json-out", default=None, help="write all rows as JSON here")
    args = ap.parse_args(argv)
    finish_args(args, QUICK if args.quick else FULL)
    target_dir = args.target or embedded_model_path("target")
    draft_dir = args.draft or embedded_model_path("draft")
    target = jaxdecode.load(target_dir, dtype="float32")
    draft = jaxdecode.load(draft_dir, dtype="float32")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens)
    n_tok = args.max_new_tokens * len(prompts)
    print(f"target {target.config.num_parameters() / 1e6:.1f} M, draft {draft.config.num_parameters() / 1e6:.1f} M, "
          f"float32; {len(prompts)} held-out prompts x {args.prompt_tokens} tokens, {args.max_new_tokens} new, "
          f"batch 1, greedy; transformers assistant: {assistant_schedule(draft_dir)}; adaptive option: "
          f"{has_option('adaptive')} (cost tables: {cost_cache_dir()}); jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, {os.cpu_count()} cores, {platform.machine()}", flush=True)

    # transformers: greedy / assisted / prompt lookup, each prompt warmed up then timed
    hf = bench_transformers(argparse.Namespace(target=target_dir, draft=draft_dir, new=args.max_new_tokens,
                                               repeats=max(args.repeats, 1), torch_threads=args.torch_threads,
                                               torch_device=args.torch_device),
                            prompts, None)
    hf_s = {r["method"]: n_tok / r["tok_s"] for r in hf}
    hf_plain, hf_assisted = hf_s["transformers greedy"], hf_s["transformers assisted (draft model)"]

    batches = [[p] for p in prompts]
    common = dict(max_new_tokens=args.max_new_tokens, eos_ids=[])
    configs = [("jaxdecode greedy", dict(method="greedy")),
               ("jaxdecode speculative draft_lm (draft model)", dict(method="speculative", draft=draft))]
    if has_option("adaptive"):
        configs.append(("jaxdecode speculative draft_lm adaptive=False",
                        dict(method="speculative", draft=draft, adaptive=False)))
    configs.append(("jaxdecode speculative (default, no options)", dict(method="speculative")))
    skipped: list = []
    jd = run_configs(target, batches, {label: kw | common for label, kw in configs}, max(args.repeats, 1), skipped)
    for label, m in jd.items():
        print(f"  {label:48s} {m['new_tokens'] / m['seconds']:.1f} tok/s  tau {m['tau']:.2f}", flush=True)
    for line in skipped:
        print(f"  skipped {line}", flush=True)
    ref = jd["jaxdecode greedy"]
    jd_plain = ref["seconds"]

    rows = [dict(library="transformers", method=r["method"], tok_s=r["tok_s"],
                 vs_own_plain=hf_plain / hf_s[r["method"]], vs_hf_assisted=hf_assisted / hf_s[r["method"]],
                 tau=None, equal=r["equal_to_jaxdecode_greedy"]) for r in hf]
    rows += [dict(library="jaxdecode", method=label, tok_s=m["new_tokens"] / m["seconds"],
                  vs_own_plain=jd_plain / m["seconds"], vs_hf_assisted=hf_assisted / m["seconds"], tau=m["tau"],
                  equal=m["outs"] == ref["outs"], compile_seconds=m["warmup_seconds"], stats=m["extra"])
             for label, m in jd.items()]
    print("\n| library | method (greedy, batch 1) | tok/s | vs same library's greedy | vs transformers assisted "
          "| tau | output == jaxdecode greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        print(f"| {r['library']} | {r['method']} | {r['tok_s']:.1f} | {r['vs_own_plain']:.2f}x | "
              f"{r['vs_hf_assisted']:.2f}x | {tau} | {'yes' if r['equal'] else 'NO'} |")
    import torch
    write_result(dict(jax=jax.__version__, platform=jax.devices()[0].platform, cpu_count=os.cpu_count(),
                      adaptive_option=has_option("adaptive"), assistant=assistant_schedule(draft_dir),
                      torch_threads=torch.get_num_threads(), torch_device=args.torch_device,
                      args=vars(args), rows=rows), args.json_out)
    return all(r["equal"] for r in rows if r["library"] == "jaxdecode")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
