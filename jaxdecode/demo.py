"""The main job (`make run` / `jaxdecode demo`): generate with the default model and report speed.

Uses the embedded target model when it is shipped; otherwise a small random-weight model, and says so
plainly (its output is meaningless text; only the speed figures mean something).
"""
from __future__ import annotations

import time

import jax
import numpy as np

from jaxdecode.api import Model, embedded_model_path, generate, load

# Openings of functions from files of the CPython standard library that the embedded models never
# trained on (held out by the corpus split: heapq.py, genericpath.py, subprocess.py). Each ends at the
# end of a line, not after its newline: the byte-level BPE merges a newline with the next line's
# indentation ("\n        " is one token), so a prompt ending in a bare "\n" is a token boundary the
# model never saw in training, and it answers with blank lines and dedents.
PROMPTS = ["def heappush(heap, item):\n    \"\"\"Push item onto heap, maintaining the heap invariant.\"\"\"",
           "def exists(path):\n    \"\"\"Test whether a path exists.  Returns False for broken symbolic links\"\"\"\n"
           "    try:",
           "def check_call(*popenargs, **kwargs):\n    \"\"\"Run command with arguments.  Wait for command to "
           "complete."]


def _random_model() -> Model:
    from jaxdecode.models import ModelConfig, init_params
    config = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                         max_position_embeddings=1024, eos_token_ids=(0,))
    return Model(config=config, params=init_params(config, jax.random.PRNGKey(0)), path="<random>")


def _timed(model, prompts, method, max_new_tokens, **opts):
    generate(model, prompts, method=method, max_new_tokens=max_new_tokens, **opts)  # compile
    start = time.perf_counter()
    out = generate(model, prompts, method=method, max_new_tokens=max_new_tokens, **opts)
    return out, time.perf_counter() - start


def _side_by_side(model, prompts, max_new_tokens, spec_opts, repeats: int = 5):
    """(greedy outputs, speculative outputs, greedy seconds, speculative seconds): each compiled first,
    then timed alternately `repeats` times (medians), so a change in the machine's load between the
    two does not show up as a speedup or a slowdown."""
    runs = {"greedy": {}, "speculative": spec_opts}
    outs = {m: generate(model, prompts, method=m, max_new_tokens=max_new_tokens, eos_ids=(), **o)  # compile
            for m, o in runs.items()}
    secs = {m: [] for m in runs}
    for _ in range(repeats):
        for m, o in runs.items():
            start = time.perf_counter()
            outs[m] = generate(model, prompts, method=m, max_new_tokens=max_new_tokens, eos_ids=(), **o)
            secs[m].append(time.perf_counter() - start)
    return outs["greedy"], outs["speculative"], float(np.median(secs["greedy"])), float(np.median(secs["speculative"]))


def run_demo(max_new_tokens: int = 64) -> int:
    print(f"jaxdecode demo on {jax.devices()[0].platform} ({jax.device_count()} device(s))")
    if embedded_model_path("target") is not None:
        model = load()
        prompts = PROMPTS
        print(f"model: embedded target ({model.config.num_parameters() / 1e6:.1f} M parameters), "
              f"trained on Python sources (the CPython standard library, then installed packages)")
    else:
        model = _random_model()
        rng = np.random.RandomState(0)
        prompts = [list(rng.randint(1, model.config.vocab_size, size=n)) for n in (12, 7, 20)]
        print("NOTE: the embedded default model is not built in this checkout (`make models`), so this "
              "demo uses a small RANDOM-weight model: its text is meaningless, only the speed is real.")
    out, secs = _timed(model, prompts, "greedy", max_new_tokens, eos_ids=())
    n_new = sum(g.stats["new_tokens"] for g in out)
    for g in out:
        shown = g.prompt + g.text if isinstance(g.prompt, str) else f"{g.prompt} -> {g.tokens}"
        print("-" * 60)
        print(shown)
    print("-" * 60)
    print(f"greedy: {n_new} new tokens for {len(out)} prompts (batched) in {secs:.3f} s "
          f"= {n_new / secs:.1f} tokens/s (compile excluded)")
    if embedded_model_path("draft") is None:
        print("speculative decoding needs the embedded draft model (`make models`); skipped")
        return 0
    draft = load("draft")
    print(f"\nspeculative decoding (greedy, lossless), measured side by side with plain greedy (median of "
          f"5 alternating calls each); the default is adaptive: each step drafts only as deep as pays, from "
          f"costs measured once on this machine (cached) and the rows' acceptance so far")
    for label, batch, opts in SPEC_CONFIGS:
        opts = dict(opts, **({"draft": draft} if opts.get("drafter") == "draft_lm" else {}))
        ref, spec, ref_secs, spec_secs = _side_by_side(model, prompts[:batch], max_new_tokens, opts)
        n = sum(g.stats["new_tokens"] for g in ref)
        same = [g.tokens for g in spec] == [g.tokens for g in ref]
        tau = sum(g.stats["tau"] for g in spec) / len(spec)
        print(f"  batch {batch}  {label:46s} tau {tau:4.2f}  {n / spec_secs:7.1f} tokens/s  speedup "
              f"{ref_secs / spec_secs:4.2f}x  {'output == greedy' if same else 'OUTPUT DIFFERS'}")
    return 0


# The speculative configurations the main job shows: (label, batch size, options); greedy verification.
# The default drafter is the target's retrieval datastore (target/drafters/retrieval).
SPEC_CONFIGS = [
    ("default (retrieval datastore, adaptive)", 1, {}),
    ("retrieval, chain of 16, fixed (adaptive=False)", 1, {"drafter": "retrieval", "adaptive": False}),
    ("draft LM, chain of 4, adaptive", 1, {"drafter": "draft_lm", "tree": "chain:4"}),
    ("default (retrieval datastore, adaptive)", len(PROMPTS), {}),
    ("draft LM, chain of 4, adaptive", len(PROMPTS), {"drafter": "draft_lm", "tree": "chain:4"}),
]
