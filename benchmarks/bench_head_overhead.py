"""What the acceptance head's machinery costs per speculative step, at equal work.

    python benchmarks/bench_head_overhead.py [--cuts 1,2,3 --head-k 8 --prompts 8 --steps 24 --rounds 16
                                              --param-dtype bfloat16]

For each cut c: EAGLE-3 (the embedded target's shipped drafter) with a fixed chain of c, against an
acceptance head over chain:--head-k whose rate is a constant p = 0.7 and whose threshold ends every
chain after exactly c nodes. Both draft and verify the same tokens every step (the script checks it), so
any difference in time is the head's machinery: the level loop that stops drafting, the head's inputs at
each level, the verification's switch over widths, and buffers sized for --head-k nodes.

Whole decodes on this kind of CPU move 5-10% between runs of one program; this times `--steps` engine
steps inside one jit call from the same post-prompt states (one per held-out prompt), round robin over
the rows for `--rounds` rounds, and reports milliseconds per step (median and lower quartile over the
rounds) with each head row's ratio to its fixed chain. Batch 1, greedy; compile time excluded.
"""
from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
from _common import (add_param_dtype_arg, heldout_prompts, interleaved_times, load_target_and_draft,
                     write_result)

from jaxdecode import speculative as spec
from jaxdecode.autoregressive import default_cache_len, pad_prompts
from jaxdecode.drafters import load_drafter, make_drafter
from jaxdecode.drafters.accept_head import AcceptHeadDrafter, without_own_cut
from jaxdecode.drafters.builders import ChainBuilder
from jaxdecode.models import split_layers, with_embed_words
from jaxdecode.sampling import SamplerConfig
from jaxdecode.verifiers import get_verifier

RATE = 0.7  # the constant head's P(accept) at every position


def constant_head(params):
    """The head's params with every weight zero and the output bias at logit(RATE)."""
    zero = jax.tree.map(jnp.zeros_like, params)
    zero["out"]["bias"] = jnp.full_like(zero["out"]["bias"], float(np.log(RATE / (1 - RATE))))
    return zero


def threshold_for_cut(c: int) -> float:
    """h between the constant head's risk after c - 1 positions and after c (1 - RATE ** i): the
    chain ends after node c."""
    return 0.5 * ((1 - RATE ** (c - 1)) + (1 - RATE ** c))


def step_runner(target, drafter, prompts, new: int, steps: int):
    """(run, tokens): run() takes `steps` engine steps from each prompt's post-prompt state (compiled
    already); tokens: each prompt's history after those steps (the prompt and what was committed). The
    room is sized as speculative_decode sizes it; costmodel's step timer is not reused because it forces
    widths through the adaptive policy, which would add the policy's bookkeeping to both rows."""
    params = split_layers(target.config, target.params)
    eos = tuple(target.config.eos_token_ids or ())
    n = drafter.num_nodes
    width = max(len(p) for p in prompts)
    kw = dict(verifier=get_verifier("greedy"), sampler=SamplerConfig(temperature=0.0), max_new_tokens=new,
              eos_ids=eos, cache_len=default_cache_len(width, new, n + 1 + drafter.max_depth + 1),
              hist_cap=width + new + drafter.max_depth + 2, attn_impl="xla",
              verify_widths=spec.check_verify_widths(getattr(drafter, "verify_widths", None), n))

    def engine(params, drafter):
        return spec._engine(target.config, with_embed_words(params), drafter, **kw)

    start = jax.jit(lambda p, d, t, lens, key: engine(p, d).start(t, lens, key))
    run_steps = jax.jit(lambda p, d, st: jax.lax.fori_loop(0, steps, lambda i, s: engine(p, d).step(s), st))
    states = []
    for i, prompt in enumerate(prompts):
        toks, lens = pad_prompts([prompt])
        states.append(start(params, drafter, toks, lens, jax.random.PRNGKey(i)))
    outs = [run_steps(params, drafter, st) for st in states]  # compile
    tokens = [np.asarray(o.history)[0, :int(o.hist_len[0])].tolist() for o in outs]

    def run():
        jax.block_until_ready([run_steps(params, drafter, st) for st in states])
    return run, tokens


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--cuts", default="1,2,3")
    ap.add_argument("--head-k", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24, help="engine steps per prompt in one timed call")
    ap.add_argument("--rounds", type=int, default=16)
    add_param_dtype_arg(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    target_dir, target, _ = load_target_and_draft(args)
    head = load_drafter(target_dir / "drafters" / "accept_head", target)
    if head.cfg.inner != "eagle3":
        raise SystemExit(f"this probe wraps EAGLE-3; the target's shipped head wraps {head.cfg.inner!r}")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens)
    cuts = [int(x) for x in args.cuts.split(",")]
    new = max(96, args.steps * (max(cuts) + 1))  # the benchmarks' 96, or room for every step's whole chain

    def eagle3(k):
        return without_own_cut(make_drafter("eagle3", target, tree=ChainBuilder(k, "argmax")))

    zero = constant_head(head.params)
    rows = {}
    for c in cuts:
        if not 1 <= c <= args.head_k:
            raise SystemExit(f"--cuts are chain lengths in 1..--head-k ({args.head_k}), got {c}")
        rows[f"chain:{c}"] = eagle3(c)
        rows[f"head over chain:{args.head_k}, cut {c}"] = AcceptHeadDrafter.wrap(eagle3(args.head_k), zero, head.cfg,
                                                                                threshold_for_cut(c))
    runners = {}
    for name, drafter in rows.items():
        runners[name] = step_runner(target, drafter, prompts, new, args.steps)
        if name.startswith("head") and runners[name][1] != runners[f"chain:{name.rsplit(' ', 1)[1]}"][1]:
            raise SystemExit(f"{name} committed other tokens than its fixed chain: the probe would compare "
                             f"unequal work")
    per_step = 1e3 / (args.steps * len(prompts))  # seconds of a call -> ms per step
    times = {name: [per_step * t for t in ts]
             for name, ts in interleaved_times({name: r[0] for name, r in runners.items()}, args.rounds).items()}
    result = {"machine": platform.platform(), "backend": jax.default_backend(), "prompts": len(prompts),
              "steps": args.steps, "rounds": args.rounds, "rows": []}
    for name in rows:
        ms = np.asarray(times[name])
        row = {"config": name, "ms_per_step": float(np.median(ms)), "ms_per_step_q25": float(np.percentile(ms, 25))}
        if name.startswith("head"):
            fixed = f"chain:{name.rsplit(' ', 1)[1]}"
            row["over_fixed"] = row["ms_per_step"] / float(np.median(times[fixed]))
            row["same_tokens"] = True  # checked before timing
        result["rows"].append(row)
        print(f"{name:28s} {row['ms_per_step']:.3f} ms/step (q25 {row['ms_per_step_q25']:.3f})"
              + (f"  x{row['over_fixed']:.3f} of its fixed chain" if "over_fixed" in row else ""))
    write_result(result, args.json)


if __name__ == "__main__":
    main()
