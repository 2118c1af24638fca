"""Export the embedded models from their latest checkpoints, evaluate them, and write the model card.

Figures in the card: tokens seen, steps, held-out nats/token and bits/byte of the shipped (bf16)
weights over the whole held-out split, against add-k unigram and bigram baselines on the same
tokenizer; training throughput; the transformers-vs-jaxdecode logit difference; the loss curves.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from jaxdecode.models import init_params, load_params

from .baselines import ngram_baselines, token_byte_lengths
from .corpus import Corpus, eval_batches
from .lm import CausalLM, evaluate_heldout, export_lm
from .recipe import EXPORT_DTYPE, PACKAGE_SAMPLE_BYTES, SEQ_LEN, phase_corpus, phases, recipe
from .tokenizer import eos_id, load_tokenizer_dir
from .trainer import read_metrics, restore_latest

NAMES = ("target", "draft")


def _complete_steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []


def choose_checkpoint(work: Path, name: str) -> tuple[int, int, float | None]:
    """(phase index, step) of the kept checkpoint with the lowest periodic held-out loss.

    Falls back to the latest checkpoint of the latest phase when no kept step was evaluated.
    """
    best, latest = None, None
    for i, (dirname, _) in enumerate(phases(name)):
        steps = _complete_steps(work / dirname / "checkpoints")
        if not steps:
            continue
        latest = (i, steps[-1], None)
        evals = {m["step"]: m["eval_loss"] for m in read_metrics(work / dirname / "metrics.jsonl")
                 if "eval_loss" in m}
        for st in steps:
            if st in evals and (best is None or evals[st] < best[2]):
                best = (i, st, evals[st])
    if latest is None:
        raise FileNotFoundError(f"no checkpoint of the {name} model under {work}; train it first "
                                f"(--stages {name})")
    return best or latest


def export_latest(work: Path, name: str, out_dir: Path, tokenizer) -> dict:
    """Export the best kept checkpoint (by periodic held-out loss) over all phases of a model."""
    config, _, spec = recipe(name, len(tokenizer), eos_id(tokenizer))
    phase, step, eval_loss = choose_checkpoint(work, name)
    plan = phases(name)
    dirname, tcfg = plan[phase]
    module = CausalLM(config, init_params(config, jax.random.PRNGKey(0)))
    module, step = restore_latest(module, tcfg, work / dirname, step=step)
    export_lm(config, module.raw_params(), tokenizer, out_dir, dtype=EXPORT_DTYPE)
    steps_before = sum(c.steps for _, c in plan[:phase])
    return {"step": steps_before + step, "phase": phase + 1, "phase_step": step,
            "selected_by_eval_loss": eval_loss,
            "phases": [{"workdir": d, "steps": c.steps, "learning_rate": c.learning_rate,
                        "warmup_steps": c.warmup_steps, "seed": c.seed, "corpus": phase_corpus(d)}
                       for d, c in plan],
            "phases_logged": [d for d, _ in plan if (work / d / "metrics.jsonl").exists()],
            "planned_steps": sum(c.steps for _, c in plan),
            "tokens_seen": (steps_before + step) * spec.batch_size * spec.seq_len,
            "batch_size": spec.batch_size, "seq_len": spec.seq_len, "learning_rate": plan[0][1].learning_rate,
            "warmup_steps": plan[0][1].warmup_steps, "seed": plan[0][1].seed,
            "parameters": config.num_parameters(), "config": config.to_hf_dict()}


def phase_metrics(work: Path, name: str, upto_step: int) -> list[dict]:
    """All phases' metrics on one step axis (phase k's steps offset by the earlier phases')."""
    out, offset = [], 0
    for dirname, tcfg in phases(name):
        path = work / dirname / "metrics.jsonl"
        if path.exists():
            out += [{**m, "step": m["step"] + offset} for m in read_metrics(path)
                    if m["step"] + offset <= upto_step]
        offset += tcfg.steps
    return out


def throughput(metrics: list[dict]) -> float | None:
    tps = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m][1:]  # first includes compile
    return float(np.median(tps)) if tps else None


def hf_logit_diff(model_dir: Path, tokens: np.ndarray) -> float:
    """Max |logits| difference between transformers and jaxdecode on the same float32 weights."""
    import torch
    from transformers import AutoModelForCausalLM
    from jaxdecode.models import causal_mask, forward
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(tokens[None].astype(np.int64))).logits.numpy()
    config, params = load_params(model_dir, dtype="float32")
    t = len(tokens)
    ours, _, _ = forward(config, params, tokens[None], np.arange(t, dtype=np.int32)[None], None,
                         causal_mask(1, t))
    return float(np.max(np.abs(np.asarray(ours) - ref)))


def plot_curves(curves: dict, baselines: dict, path: Path) -> Path | None:
    """The loss curves of the release's models; None (skipped with a warning) without matplotlib."""
    from .drafters import pyplot
    plt = pyplot(path)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"target": "tab:blue", "draft": "tab:orange"}
    for name, (tokens_per_step, metrics, boundaries) in curves.items():
        for b in boundaries:  # a new training phase (fresh optimizer and schedule) starts here
            ax.axvline(b * tokens_per_step / 1e6, color=colors.get(name), ls=":", lw=1, alpha=0.6)
        tr = [(m["step"] * tokens_per_step / 1e6, m["loss"]) for m in metrics if "loss" in m]
        ev = [(m["step"] * tokens_per_step / 1e6, m["eval_loss"]) for m in metrics if "eval_loss" in m]
        if tr:
            x, y = zip(*tr)
            ax.plot(x, y, color=colors.get(name), alpha=0.35, lw=1, label=f"{name} train")
        if ev:
            x, y = zip(*ev)
            ax.plot(x, y, "o-", color=colors.get(name), lw=2, ms=3, label=f"{name} held-out")
    for name, style in (("unigram", ":"), ("bigram", "--")):
        ax.axhline(baselines[name]["nats_per_token"], color="gray", ls=style,
                   label=f"{name} baseline (held-out)")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, 8.5)
    ax.set_title("Embedded models: loss on CPython stdlib sources")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _package_corpus(work: Path) -> dict | None:
    """What the package phases trained on: the packages' slices and the corpus's split sizes."""
    record, corpus_dir = work / "packages-src" / "packages.json", work / "corpus-packages"
    if not record.exists() or not (corpus_dir / "manifest.json").exists():
        return None
    splits = Corpus.open(corpus_dir).manifest["splits"]
    return {"packages": json.loads(record.read_text()),
            "splits": {s: {k: v for k, v in splits[s].items() if k != "shards"} for s in ("train", "heldout")}}


def _previous_release_rows(previous: dict, models: dict, retrained) -> dict:
    """label -> label in the earlier report, for the rows that show a retrained model's previous weights:
    the earlier report's own row when it shipped other weights, else the row it kept as the previous
    release (a report rerun on the same run must not call the new weights the previous ones)."""
    rows = {}
    for n in retrained:
        old = previous.get("models", {}).get(n)
        if old is None:
            continue
        same = (old.get("phase"), old.get("phase_step")) == (models[n]["phase"], models[n]["phase_step"])
        rows[f"{n}, previous release"] = f"{n}, previous release" if same else n
    return rows


def _reusable_rows(compression: dict | None, rows: dict) -> dict:
    """{split: {label: row}} of an earlier report's model rows (`rows`: label -> its label there) that
    can stand beside new ones: same weights (the caller's promise) and the same files (checked)."""
    if not compression or compression.get("context") != SEQ_LEN:
        return {}
    return {split: {label: col["models"][old] for label, old in rows.items() if old in col["models"]}
            | {"_files": (col["files"], col["bytes"])}
            for split, col in compression["splits"].items()}


def compression_report(out: Path, names, context: int = SEQ_LEN, progress=None, reuse: dict | None = None) -> dict:
    """Bits/byte of the shipped models in `out` (scored per file, training.compression) against bz2,
    gzip and xz, on the held-out stdlib files and on a fixed sample of sources outside the corpus.
    `reuse` ({split: {label: row, "_files": (files, bytes)}}, `_reusable_rows`): rows of models scored
    by an earlier report, added after the new ones when that split's files are the same."""
    from jaxdecode.models import load_params

    from .compression import compressor_bits_per_byte, heldout_stdlib_files, model_bits_per_byte, outside_files
    outside, versions = outside_files()
    splits = {"heldout": heldout_stdlib_files(), "outside": outside}
    res = {"context": context, "stride": context // 2, "outside_packages": versions, "splits": {}}
    for split, files in splits.items():
        row = {"files": len(files), "bytes": sum(len(f.data) for f in files),
               "compressors": compressor_bits_per_byte(files), "models": {}}
        for name in names:
            config, params = load_params(out / name, dtype="float32")
            row["models"][name] = model_bits_per_byte(config, params, load_tokenizer_dir(out / name), files,
                                                      context, progress=progress)
        earlier = dict((reuse or {}).get(split, {}))
        if earlier.pop("_files", None) == (row["files"], row["bytes"]):
            row["models"].update(earlier)
        res["splits"][split] = row
    return res


def _portable(command: str) -> str:
    """The command line with absolute paths cut to their last part (the card names no machine paths)."""
    return " ".join(f"<{Path(a).name or 'root'}>" if Path(a).is_absolute() else a for a in command.split())


def refresh_report(out: Path, command: str) -> dict:
    """Rewrite the card and metrics.json of models already in `out` without their training run (its
    checkpoints and logs gone): the recorded training facts are kept, the compression comparison is
    measured anew on the shipped weights; the weights and loss_curves.png are left as they are."""
    with open(out / "metrics.json") as f:
        report = json.load(f)
    report.pop("corpus_root", None)  # older reports held the build machine's stdlib path
    report.update(command=_portable(command), refreshed=time.strftime("%Y-%m-%d"),
                  compression=compression_report(out, [n for n in NAMES if n in report["models"]]))
    with open(out / "metrics.json", "w") as f:
        json.dump(report, f, indent=1)
    (out / "MODEL_CARD.md").write_text(model_card(report))
    return report


def build_report(work: Path, out: Path, command: str, eval_windows: int = 256) -> dict:
    """Export, evaluate and document both models. eval_windows: held-out windows scored, spread
    evenly over the split (0: every held-out token)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer_dir(work / "tokenizer")
    corpus = Corpus.open(work / "corpus")
    corpus.check_tokenizer(tokenizer)
    train_tokens, heldout = corpus.tokens("train"), corpus.tokens("heldout")
    batches = eval_batches(heldout, 8, SEQ_LEN, max_batches=-(-eval_windows // 8) if eval_windows else None)
    byte_lengths = token_byte_lengths(tokenizer)
    report = {"corpus": {s: {k: v for k, v in corpus.manifest["splits"][s].items() if k != "shards"}
                         for s in ("train", "heldout")},
              "skipped_files": [r for r in corpus.manifest["files"] if "skipped" in r],
              "held_out_fraction": corpus.manifest["held_out_fraction"],
              "vocab_size": len(tokenizer),
              "python": platform.python_version(), "command": _portable(command),
              "date": time.strftime("%Y-%m-%d"), "models": {}}
    report["baselines"] = ngram_baselines(train_tokens, batches, len(tokenizer), byte_lengths)
    report["eval"] = {"windows": eval_windows or "all", "seq_len": SEQ_LEN}
    previous = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    package_corpus = _package_corpus(work)
    if package_corpus:
        report["package_corpus"] = package_corpus
    curves, carried = {}, []
    for name in NAMES:
        distilled = previous.get("models", {}).get(name, {}).get("distilled")
        if distilled or not any((work / d / "checkpoints").is_dir() for d, _ in phases(name)):
            # Its run is gone, or it was replaced by the distilled draft (`record_distilled_draft`, which the
            # from-scratch run must not overwrite): keep what its own report recorded.
            if name in previous.get("models", {}):
                report["models"][name] = {**previous["models"][name], "carried_over": previous.get("date")}
                carried.append(name)
            continue
        info = export_latest(work, name, out / name, tokenizer)
        config, params = load_params(out / name, dtype="float32")
        info["heldout"] = evaluate_heldout(config, params, batches, byte_lengths)
        metrics = phase_metrics(work, name, info["step"])
        info["train_tokens_per_s"] = throughput(metrics)
        info["train_loss_last"] = next((m["loss"] for m in reversed(metrics) if "loss" in m), None)
        info["hf_max_logit_diff"] = hf_logit_diff(out / name, heldout[:64].astype(np.int32))
        info["bytes_on_disk"] = sum(f.stat().st_size for f in (out / name).iterdir())
        report["models"][name] = info
        starts = np.cumsum([p["steps"] for p in info["phases"]])[:-1]
        curves[name] = (info["batch_size"] * info["seq_len"], metrics,
                        [int(b) for b in starts if b < info["step"]])
    plot_curves(curves, report["baselines"], out / "loss_curves.png")
    report["compression"] = compression_report(
        out, [n for n in report["models"] if n not in carried],
        reuse=_reusable_rows(previous.get("compression"), {n: n for n in carried}
                             | _previous_release_rows(previous, report["models"], curves)))
    with open(out / "metrics.json", "w") as f:
        json.dump(report, f, indent=1)
    (out / "MODEL_CARD.md").write_text(model_card(report))
    return report


def record_distilled_draft(work: Path, out: Path, run_dir: Path, export_dir: Path, command: str,
                           recipe: dict, eval_windows: int = 256) -> dict:
    """Ship the draft LM distilled on-policy from the shipped target (`jaxdecode train draft-lm --data self`
    with `recipe` (recipe.DISTILLED_DRAFT), its work directory `run_dir`, its export `export_dir`) as
    `out/draft`: bf16 weights; in metrics.json its training facts, held-out loss on the report's windows,
    bits/byte and the transformers check, the replaced draft's compression rows kept as "draft, previous
    release"; the card rewritten."""
    from jaxdecode.models.hf import load_tokenizer

    from .compression import heldout_stdlib_files, model_bits_per_byte, outside_files
    report = json.loads((out / "metrics.json").read_text())
    tokenizer = load_tokenizer_dir(out / "target")
    config, params = load_params(export_dir, dtype="float32")
    export_lm(config, params, load_tokenizer(export_dir), out / "draft", dtype=EXPORT_DTYPE)
    config, params = load_params(out / "draft", dtype="float32")  # scored as shipped: bf16 weights
    heldout = Corpus.open(work / "corpus").tokens("heldout")
    batches = eval_batches(heldout, 8, SEQ_LEN, max_batches=-(-eval_windows // 8) if eval_windows else None)
    metrics = read_metrics(run_dir / "run" / "metrics.jsonl")
    evals = [m for m in metrics if "tau" in m]
    shards = sorted((run_dir / "data").glob("self-*/manifest.json"))
    if len(shards) != 1:
        raise SystemExit(f"expected one self-distillation data set under {run_dir / 'data'}, found {len(shards)}")
    data = json.loads(shards[0].read_text())
    step, seq_len = max(m["step"] for m in metrics), data["seq_len"]
    r = recipe
    report["models"]["draft"] = {
        "step": step, "phase": 1, "phase_step": step, "planned_steps": r["steps"],
        "phases": [{"workdir": run_dir.name, "steps": r["steps"], "learning_rate": r["learning_rate"],
                    "warmup_steps": r["warmup_steps"], "seed": r["seed"], "corpus": "self"}],
        "tokens_seen": step * r["batch_size"] * seq_len, "batch_size": r["batch_size"],
        "seq_len": seq_len, "learning_rate": r["learning_rate"],
        "warmup_steps": r["warmup_steps"], "seed": r["seed"],
        "parameters": config.num_parameters(), "config": json.loads((out / "draft" / "config.json").read_text()),
        "heldout": evaluate_heldout(config, params, batches, token_byte_lengths(tokenizer)),
        "train_tokens_per_s": throughput(metrics),
        "train_loss_last": next((m["loss"] for m in reversed(metrics) if "loss" in m), None),
        "hf_max_logit_diff": hf_logit_diff(out / "draft", heldout[:64].astype(np.int32)),
        "bytes_on_disk": sum(f.stat().st_size for f in (out / "draft").iterdir()),
        "distilled": {"data": "self", **data["key"]["options"], "rows": data["rows"],
                      "continuation_tokens": data["continuation_tokens"],
                      "date": time.strftime("%Y-%m-%d"),
                      "heldout_acceptance": [{k: e[k] for k in ("step", "tau", "accept_by_depth", "eval_loss")}
                                             for e in evals]},
    }
    compression = report.get("compression")
    if compression:  # the new draft's rows; the replaced draft's kept beside them
        files = {"heldout": heldout_stdlib_files(), "outside": outside_files()[0]}
        for split, col in compression["splits"].items():
            old = col["models"].pop("draft", None)
            col["models"]["draft"] = model_bits_per_byte(config, params, tokenizer, files[split],
                                                         compression["context"])
            if old is not None:
                col["models"]["draft, previous release"] = old
    report.update(command=_portable(command), date=time.strftime("%Y-%m-%d"))
    with open(out / "metrics.json", "w") as f:
        json.dump(report, f, indent=1)
    (out / "MODEL_CARD.md").write_text(model_card(report))
    return report


def _scored_line(r: dict, h: dict) -> str:
    w = r["eval"]["windows"]
    where = ("every held-out token after the first" if w == "all"
             else f"{w} windows of {r['eval']['seq_len']} tokens spread evenly over the held-out split")
    return (f"Scored: {h['tokens']:,} held-out tokens ({h['bytes']:,} bytes; {where}; EOS separators "
            f"included; each token conditioned on the tokens before it in its window).")


def compression_section(c: dict | None) -> list[str]:
    """The card's comparison with general-purpose compressors (nothing when it was not measured)."""
    if not c:
        return []
    where = {"heldout": "held-out stdlib", "outside": "outside the corpus"}
    splits = list(c["splits"])
    cols = [c["splits"][s] for s in splits]
    models = list(cols[0]["models"])
    lines = [
        "## Compression: bits per byte against bz2, gzip and xz",
        "| bits/byte | " + " | ".join(f"{where.get(s, s)} ({col['files']} files, {col['bytes'] / 1e3:.0f} KB)"
                                    for s, col in zip(splits, cols)) + " |",
        "|---" * (len(splits) + 1) + "|",
    ]
    for m in models:
        lines.append(f"| **{m}** (each file on its own, context <= {c['context']} tokens) | "
                     + " | ".join(f"**{col['models'][m]['bits_per_byte']:.3f}**" for col in cols) + " |")
    for k in cols[0]["compressors"]:
        label = k.replace(" whole", " (whole split as one stream)")
        lines.append(f"| {label} | " + " | ".join(f"{col['compressors'][k]:.3f}" for col in cols) + " |")
    if models:
        m = models[0]

        def gap(col, k):
            return f"{col['models'][m]['bits_per_byte'] - col['compressors'][k]:+.3f}"
        lines.append("")
        lines.append(f"{m} minus bz2 -9: " + "; ".join(
            f"{where.get(s, s)}: {gap(col, 'bz2 -9 per file')} bits/byte per file, "
            f"{gap(col, 'bz2 -9 whole')} against the whole split" for s, col in zip(splits, cols))
            + " (negative: the model compresses better).")
    pkgs = ", ".join(f"{k} {v}" for k, v in c.get("outside_packages", {}).items())
    lines += [
        "",
        f"The model scores each file alone with a sliding window ({c['context']} tokens, stride {c['stride']}, every",
        "token scored once; the first token is conditioned on `<|endoftext|>`, which is itself not scored): the file's",
        "nats / ln 2 / its UTF-8 bytes, summed over the split, i.e. what an arithmetic coder driven by the model would",
        "need to within a few bits per file. The compressors code the same files one by one (sizes summed, headers",
        "included) and as one stream of the whole split (they then reuse earlier files' text; the model does not).",
        "Outside the corpus: a fixed ~300 KB sample of installed packages' sources, chosen by a salted hash of each",
        f"path (`jaxdecode.training.compression.outside_files`; here {pkgs}).",
        "Reproduce: `python benchmarks/bench_compression.py [--model DIR]`.",
        "",
    ]
    return lines


def _wrapped(text: str, indent: str, width: int = 110) -> list[str]:
    import textwrap
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent)


def _package_lines(pc: dict | None) -> list[str]:
    if not pc:
        return []
    pk, sp = pc["packages"], pc["splits"]
    return [
        f"- Package phase (`corpus-packages`): the stdlib above plus {len(pk)} installed packages, about",
        f"  {PACKAGE_SAMPLE_BYTES / 1e6:.1f} MB of `*.py` each, files taken in the order of a salted hash of their path",
        "  (`jaxdecode.training.corpus.sample_package_sources`; vendored stdlib copies such as setuptools'",
        "  `_distutils` excluded, so no held-out stdlib file leaks in; never a package of the outside-corpus",
        "  sample below):",
        *_wrapped(", ".join(f"{k} {v['version']}" for k, v in pk.items()) + ".", "  "),
        f"  Train: {sp['train']['documents']} files, {sp['train']['bytes']:,} bytes, {sp['train']['tokens']:,} tokens;"
        f" held-out: {sp['heldout']['documents']} files, {sp['heldout']['tokens']:,} tokens",
        "  (the stdlib files keep their split; package files get one by the same rule).",
    ]


def _curve_gaps(models: dict) -> list[str]:
    """Say which phases the plot lacks (their logs did not survive) and which models were not retrained."""
    out = []
    for n, i in models.items():
        if i.get("carried_over"):
            out.append(f"The {n} was not retrained for this report: its row and figures are those its own report "
                       f"recorded ({i['carried_over']}), and the plot has no curve of it.")
        elif "phases_logged" in i and len(i["phases_logged"]) < len(i["phases"]):
            out.append(f"The {n}'s curve shows only " + ", ".join(i["phases_logged"]) + " (the logs of the earlier "
                       "phases were not kept); a package phase's held-out dots are on its own held-out split "
                       "(stdlib + packages), the table above on the stdlib's.")
    return out


# How the card names a training phase's data (its `corpus` field).
_PHASE_DATA = {"corpus": "", "corpus-packages": " (stdlib + packages)", "self": " (the target's own continuations)"}


def _distilled_lines(m: dict) -> list[str]:
    """The Training section's account of the draft: distilled on-policy, or trained from scratch."""
    d = m.get("draft", {}).get("distilled")
    if not d:
        return ["with the lowest periodic held-out loss (a mild selection on the held-out split). The draft is trained from",
                "scratch, not distilled, so both could train at once; `jaxdecode train lm --teacher DIR` distils one."]
    acc = d["heldout_acceptance"]
    return ["with the lowest periodic held-out loss (a mild selection on the held-out split).", "", *_wrapped(
        f"The draft is distilled on-policy from the shipped target ({d['date']}, stage `distill-draft`): "
        f"`jaxdecode train draft-lm --data self` trains it from scratch on the target's own continuations of "
        f"{d['num_prompts']} training-split prompts ({d['prompt_len']} prompt tokens + {d['new_tokens']}, "
        f"{d['greedy_fraction']:.0%} greedy, the rest sampled at T = {d['temperature']}; "
        f"{d['continuation_tokens']:,} continuation tokens). It learns what the target writes rather than the "
        f"corpus, so its held-out loss on corpus text is higher than a corpus-trained draft's while the target "
        f"accepts more of its drafts. Held-out acceptance during training (greedy speculative runs of the target "
        f"on held-out prompts, chain of 4): tau " + ", ".join(f"{e['tau']:.2f} at step {e['step']}" for e in acc)
        + ". The plot above has no curve of it (its loss is on other text).", "")]


def model_card(r: dict) -> str:
    b = r["baselines"]
    c = r["corpus"]
    pc = r.get("package_corpus")
    lines = [
        "# jaxdecode embedded models: `target` and `draft`",
        "",
        "Two small Llama-style causal LMs that share one byte-level BPE tokenizer, trained from scratch",
        "by `jaxdecode.training` on the Python sources of the CPython standard library"
        + (" (the target's last phase also on a slice of installed packages' sources)" if pc else "")
        + (" and, for the draft, on the target's own continuations (distilled on-policy)"
           if r["models"].get("draft", {}).get("distilled") else "") + ", so that",
        "the decoders, tests and benchmarks run offline on any machine. They are tiny: use them to exercise and",
        "measure decoding (speculative decoding needs a target and a draft that agree often), not as code",
        "assistants.",
        "",
        "## Corpus and split",
        f"- Source: every `*.py` file of the CPython {r['python']} standard library (the `sysconfig` stdlib path,",
        "  `sysconfig.get_paths()[\"stdlib\"]`), `site-packages` excluded. Documents are joined with `<|endoftext|>`.",
        "- Split by file: a file is held out when `sha256('jaxdecode-split:' + relative_path)` falls in",
        f"  the first {r['held_out_fraction']:.0%} of the hash range; the tokenizer saw only training files.",
        f"- Train: {c['train']['documents']} files, {c['train']['bytes']:,} bytes, {c['train']['tokens']:,} tokens.",
        f"  Held-out: {c['heldout']['documents']} files, {c['heldout']['bytes']:,} bytes, {c['heldout']['tokens']:,} tokens.",
        f"- {len(r['skipped_files'])} files were skipped (not UTF-8 or empty); `runs/embedded/corpus/manifest.json`",
        "  lists each with its reason.",
        *_package_lines(pc),
        f"- Tokenizer: byte-level BPE, {r['vocab_size']} tokens (`tokenizers` library), `<|endoftext|>` = id 0 is",
        "  EOS / BOS / padding. Saved with `PreTrainedTokenizerFast`: `AutoTokenizer.from_pretrained(dir)` works offline.",
        "",
        "## Models",
    ]
    m = r["models"]
    names = [n for n in ("target", "draft") if n in m]
    lines += ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label, fn):
        return f"| {label} | " + " | ".join(fn(m[n]) for n in names) + " |"
    lines += [
        row("parameters", lambda i: f"{i['parameters'] / 1e6:.2f} M"),
        row("layers x hidden (MLP)", lambda i: f"{i['config']['num_hidden_layers']} x {i['config']['hidden_size']} ({i['config']['intermediate_size']})"),
        row("heads / kv heads x head dim", lambda i: f"{i['config']['num_attention_heads']} / {i['config']['num_key_value_heads']} x {i['config']['head_dim']}"),
        row("tied embeddings", lambda i: str(i['config']['tie_word_embeddings'])),
        row("context (trained / max)", lambda i: f"{i['seq_len']} / {i['config']['max_position_embeddings']}"),
        row("steps (of planned)", lambda i: f"{i['step']} ({i['planned_steps']})"),
        row("training phases (steps, peak LR, warmup, data seed)", lambda i: "; ".join(
            f"{p['steps']}, {p['learning_rate']}, {p['warmup_steps']}, {p['seed']}"
            + _PHASE_DATA.get(p.get("corpus", "corpus"), f" ({p.get('corpus')})") for p in i["phases"])),
        row("shipped checkpoint", lambda i: f"phase {i['phase']} step {i['phase_step']}"),
        row("tokens seen", lambda i: f"{i['tokens_seen'] / 1e6:.2f} M"),
        row("batch x seq", lambda i: f"{i['batch_size']} x {i['seq_len']}"),
        row("training throughput (CPU)", lambda i: f"{i['train_tokens_per_s']:.0f} tokens/s" if i['train_tokens_per_s'] else "-"),
        row("**held-out nats/token**", lambda i: f"**{i['heldout']['nats_per_token']:.3f}**"),
        row("**held-out bits/byte**", lambda i: f"**{i['heldout']['bits_per_byte']:.3f}**"),
        row("stored as", lambda i: f"bf16 safetensors, {i['bytes_on_disk'] / 1e6:.1f} MB"),
        row("max abs logit diff vs transformers (f32)", lambda i: f"{i['hf_max_logit_diff']:.1e}"),
        "",
        "## Held-out loss against count baselines (same tokenizer, same scored tokens)",
        "| model | nats/token | bits/byte |",
        "|---|---|---|",
        f"| unigram, add-k (k={b['unigram']['k']}) | {b['unigram']['nats_per_token']:.3f} | {b['unigram']['bits_per_byte']:.3f} |",
        f"| bigram, add-k (k={b['bigram']['k']}) | {b['bigram']['nats_per_token']:.3f} | {b['bigram']['bits_per_byte']:.3f} |",
    ]
    for n in names:
        h = m[n]["heldout"]
        lines.append(f"| {n} | {h['nats_per_token']:.3f} | {h['bits_per_byte']:.3f} |")
    lines += [
        "",
        _scored_line(r, m[names[0]]["heldout"]),
        "bits/byte = total nats / ln 2 / the UTF-8 bytes those tokens stand for. The baselines are scored on exactly",
        "the same tokens, and their k was picked on them (which favours the baselines). The models are scored as",
        "shipped (bf16 weights, float32 compute).",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "[loss_curves.png](loss_curves.png): training loss (thin) and held-out loss during training (dots: 32 windows of",
        "256 tokens spread over the held-out split, for speed) against tokens seen; grey lines: the baselines on the",
        "tokens scored above; dotted verticals: a new training phase starts.",
        *_curve_gaps(m),
        "",
    ]
    lines += compression_section(r.get("compression"))
    lines += [
        "## Training",
        "AdamW (b1 0.9, b2 0.95, weight decay 0.1 on matrices), linear warmup then cosine decay to 10% of the peak,",
        "global-norm clipping at 1.0, float32 on CPU, random windows of the training stream (batch order a pure",
        "function of (seed, step), so runs resume exactly). Each further phase restarts AdamW with its own warmup,",
        "cosine and data seed from the previous phase's final weights (the time a run would get on a shared CPU was",
        "not known in advance, and a finished cosine cannot be extended). A package phase reads the stdlib plus the",
        "package slice above from the previous phase's weights. The shipped checkpoint is the kept one",
        *_distilled_lines(m),
        "Throughput was measured during these runs, on 2 CPU cores shared with other jobs.",
        "",
        "## Reproduce",
        "```",
        "python -m jaxdecode.training.build_embedded          # or: make models",
        "```",
        "Stages (`--stages tokenizer,corpus,target,draft,report,dllm,distill-draft`) resume from `runs/embedded/`;",
        "`report` re-exports the latest checkpoints into `models/embedded/` and rewrites this card and `metrics.json`;",
        "`distill-draft` replaces the draft by one distilled from the exported target and records it here (a later",
        "`report` keeps it). This card was written by:",
        "```",
        _portable(r["command"]),
        "```",
        *([f"(`--refresh`, {r['refreshed']}: the training facts above are those recorded by the report that exported",
           "the weights; the compression comparison was measured anew on the shipped weights.)"]
          if r.get("refreshed") else []),
        "Load: `jaxdecode.models.load_params('models/embedded/target', dtype='float32')`, or",
        "`transformers.AutoModelForCausalLM.from_pretrained('models/embedded/target')`.",
        "",
        "## Trained drafters",
        "The target ships trained drafters in `target/drafters/<kind>/` (found by `drafter=KIND` without",
        "`drafter_dir`); their card, with data, steps, time and held-out acceptance: DRAFTERS.md.",
        "",
    ]
    return "\n".join(lines)
