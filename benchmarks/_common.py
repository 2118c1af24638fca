"""Shared helpers of the benchmark scripts: timing, result files, prompts no model trained on.

Scripts import it as `from _common import ...` (Python puts a script's own folder on sys.path).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxdecode.training.compression import OUTSIDE_PACKAGES  # noqa: F401 (one list: prompts, bench_compression)


def median_seconds(fn, repeats: int, warmup: int = 0) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_times(fns: dict, repeats: int) -> dict:
    """{name: [wall seconds of each round]} of each `fns[name]()` (already warm), timed round robin: every
    round runs each once, so drift in the machine's load (thermal, another process) hits them alike
    instead of whichever was timed last, and two rows' times in one round make a ratio."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """{name: median wall seconds} of each `fns[name]()` over `repeats` rounds (`interleaved_times`)."""
    return {name: statistics.median(t) for name, t in interleaved_times(fns, repeats).items()}


def queued_us(fn, repeats: int) -> float:
    """Microseconds per call of `fn()` (a jitted JAX call) with calls queued back to back and blocked
    once at the end, best of three such batches after two warm-ups: the device time per call once it
    exceeds the host's dispatch time, which a call blocked on its own (~40-80 us through jit on a GPU)
    would hide."""
    import jax
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(repeats)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 1e6 * best


def timed(fn, repeats: int):
    """(result of the last call, median seconds): one untimed call first (compile / warm-up)."""
    out = [fn()]

    def call():
        out[0] = fn()
    return out[0], median_seconds(call, repeats) if repeats else 0.0


def decode_in_batches(decode_rows, n: int, batch: int):
    """decode_rows(idx int[batch]) over n rows in batches (the last one wrapping round to the first rows,
    so one shape compiles once), after one untimed compile call. Returns (outputs, seconds of the timed
    pass) and `rows(outputs, field)` concatenates a field of them back to n rows."""
    def run(lo):
        out = decode_rows(np.arange(lo, lo + batch) % n)
        np.asarray(out.tokens)  # block until the device is done
        return out
    run(0)  # compile
    outs, start = [], time.perf_counter()
    for lo in range(0, n, batch):
        outs.append(run(lo))
    return outs, time.perf_counter() - start


def rows(outs, n: int, field) -> np.ndarray:
    """field(output) of every batch of decode_in_batches, concatenated to its n rows."""
    return np.concatenate([np.asarray(field(o)) for o in outs])[:n]


def write_result(result: dict, path: str | None) -> None:
    """Print the result as one JSON line, and write it to `path` when given."""
    print(json.dumps(result, default=float))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=float)


def _windows(texts: list[str], tokenizer, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    out = []
    for i in rng.permutation(len(texts))[:n]:
        ids = tokenizer.encode(texts[i], add_special_tokens=False)
        start = rng.randint(0, max(1, len(ids) - prompt_tokens - 1))
        out.append(ids[start:start + prompt_tokens])
    return out


def heldout_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Prompts from held-out stdlib files (the split the embedded models never trained on)."""
    import sysconfig

    from jaxdecode.training.corpus import iter_texts
    from jaxdecode.training.recipe import HELD_OUT_FRACTION
    texts = [t for t in iter_texts([sysconfig.get_paths()["stdlib"]], held_out_fraction=HELD_OUT_FRACTION,
                                   split="heldout") if len(t) > 4000]
    return _windows(texts, tokenizer, n, prompt_tokens, seed)


def outside_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Prompts from Python source outside the embedded corpus (installed packages: optax, flax, ...),
    which no shipped model or drafter trained on; sorted paths, so every machine draws alike."""
    import importlib
    from pathlib import Path
    texts = []
    for name in OUTSIDE_PACKAGES:
        try:
            root = Path(importlib.import_module(name).__file__).parent
        except ImportError:
            continue
        for path in sorted(root.rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if len(text) > 4000 and "test" not in path.name:
                texts.append(text)
    if not texts:
        raise RuntimeError(f"none of {OUTSIDE_PACKAGES} is installed: no outside-corpus prompts")
    return _windows(texts, tokenizer, n, prompt_tokens, seed)


# Where timed prompts come from: the two sources no shipped model or drafter trained on.
PROMPT_SOURCES = {"heldout": heldout_prompts, "outside": outside_prompts}


def source_names(text: str) -> list[str]:
    """The argparse type of --sources: a comma list of prompt sources checked against PROMPT_SOURCES
    (the parser's error names the unknown ones and the choices)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(PROMPT_SOURCES))
    if not names:
        raise argparse.ArgumentTypeError(f"no prompt source given ({text!r}); choose from {', '.join(PROMPT_SOURCES)}")
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown prompt source(s) {unknown}; choose from {', '.join(PROMPT_SOURCES)}")
    return names


def prompts_by_source(names: list[str], tokenizer, n: int, prompt_tokens: int) -> dict:
    """{source: n prompts of prompt_tokens tokens} for each name of source_names."""
    return {s: PROMPT_SOURCES[s](tokenizer, n, prompt_tokens) for s in names}


def finish_args(args, presets: dict) -> None:
    """Unset arguments from `presets` (a script's QUICK or FULL sizes); `--cost-cache` becomes
    JAXDECODE_CACHE_DIR (where adaptive speculation keeps its measured cost tables)."""
    import os
    for k, v in presets.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if getattr(args, "cost_cache", None):
        os.environ["JAXDECODE_CACHE_DIR"] = args.cost_cache


def add_param_dtype_arg(ap):
    """--param-dtype: weight-only half precision for the models a benchmark loads."""
    ap.add_argument("--param-dtype", default=None, choices=["bfloat16", "float16"],
                    help="store the models' weight matrices in this dtype, computing in float32 (load(param_dtype=))")


def drafts_with_lm(name: str, target, drafter_dir=None) -> bool:
    """Whether drafter kind `name` takes a draft LM (`draft=`): draft_lm, and an acceptance head trained over
    one (its config's `inner`, from drafter_dir or the head shipped beside `target`; the embedded target's
    head wraps EAGLE-3 and refuses a draft LM)."""
    from jaxdecode.drafters import find_drafter_dir, read_drafter_config
    if name != "accept_head":
        return name == "draft_lm"
    base = drafter_dir or find_drafter_dir(target, name)
    return base is not None and read_drafter_config(base)["config"].get("inner", "draft_lm") == "draft_lm"


def load_target_and_draft(args):
    """(target dir, target, draft) computing in float32: --target / --draft, else the embedded models;
    their weight matrices in --param-dtype when the script has that option (add_param_dtype_arg)."""
    from pathlib import Path

    import jaxdecode
    from jaxdecode.model import embedded_model_path
    target_dir = Path(args.target or embedded_model_path("target"))
    kw = dict(dtype="float32", param_dtype=getattr(args, "param_dtype", None))
    draft = jaxdecode.load(args.draft or embedded_model_path("draft"), **kw)
    return target_dir, jaxdecode.load(target_dir, **kw), draft
