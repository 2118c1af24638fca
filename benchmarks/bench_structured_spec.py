"""Speculative decoding under JSON schemas on the embedded target: how much of the speculative speedup a
constraint keeps (goal: >= 80%).

    python benchmarks/bench_structured_spec.py [--quick] [--batch 1,4] [--new 96] [--repeats 5] [--json FILE]
        [--workloads code,records]

Per drafter and batch size, four timed runs (one compile call first): plain greedy and speculative
greedy, each unconstrained and under JSON schemas (one schema per row, stacked automata), all with EOS.
speedup = greedy seconds per token / speculative seconds per token; kept = constrained speedup /
unconstrained speedup. Constrained speculative output is checked token for token against constrained
greedy (an error otherwise). `measure(...)` is what bench_structured.py's `spec` section may import.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import timed, write_result  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"},
                                                                          "maxItems": 3}},
     "required": ["id", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["file", "dir", "link"]},
                                      "path": {"type": "string", "maxLength": 24}},
     "required": ["ok", "kind", "path"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 6},
]
PROMPTS = ["def describe(person):\n    return ", "# config\nvalue = ", "result = ", "data = "]
# A second workload where the output has something to copy (few-shot JSON lines, the next record is the
# answer): a copy-based drafter's unconstrained speedup comes from copying, and the code prompts above
# give it nothing to copy into a JSON answer.
RECORDS = ['people = [\n{"name": "alice", "age": 31},\n{"name": "bob", "age": 42},\n{"name": "carol", "age": 27},\n',
           'items = [\n{"id": 1, "tags": ["a", "b"]},\n{"id": 2, "tags": ["b"]},\n{"id": 3, "tags": ["a", "c"]},\n',
           'entries = [\n{"ok": true, "kind": "file", "path": "a.txt"},\n{"ok": false, "kind": "dir", "path": "src"},\n'
           '{"ok": true, "kind": "link", "path": "b.txt"},\n',
           'rows = [\n[1, 2, 3],\n[4, 5, 6],\n[7, 8, 9],\n']
# A third, the control: held-out code prompts under a regex every text matches (ANY_TEXT), so the target
# writes exactly its unconstrained text and `kept` is what the constraint machinery alone (masks, tree
# pruning, constrained verification) costs the speculative speedup.
ANY_TEXT = r"[\s\S]*"
WORKLOADS = {"code": PROMPTS, "records": RECORDS, "anytext": None}  # anytext: held-out windows, loaded in main
# (label, drafter name, tree, needs the draft model, adaptive speculation: what generate() runs by default)
DRAFTERS = (("prompt_lookup", "prompt_lookup", None, False, False),
            ("prompt_lookup adaptive", "prompt_lookup", None, False, True),
            ("draft_lm chain:4", "draft_lm", "chain:4", True, False),
            ("draft_lm chain:4 adaptive", "draft_lm", "chain:4", True, True),
            ("draft_lm eagle:4,4,16", "draft_lm", "eagle:depth=4,topk=4,total=16", True, False))
QUICK = dict(batch="1", new=24, repeats=1, drafters=2)
FULL = dict(batch="1,4", new=96, repeats=5, drafters=len(DRAFTERS))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def _prompts(tokenizer, texts):
    ids = [tokenizer(t)["input_ids"] for t in texts]
    toks = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for i, row in enumerate(ids):
        toks[i, :len(row)] = row
    return toks, np.asarray([len(r) for r in ids], np.int32)


def constraint_for(model, schemas):
    """One automaton row per schema (stacked when rows differ)."""
    from jaxdecode.constraints import automaton as am
    kw = dict(vocab_size=model.config.vocab_size, eos_ids=(0,))
    if all(s == ANY_TEXT for s in schemas):
        return am.compile_regex(ANY_TEXT, model.tokenizer, **kw).constraint()
    per_row = getattr(am, "per_row_constraint", None)
    if per_row is not None:
        return per_row(schemas, model.tokenizer, **kw)
    if any(s != schemas[0] for s in schemas):
        raise SystemExit("this build cannot stack automata (no per_row_constraint): use one schema")
    return am.compile_json_schema(schemas[0], model.tokenizer, **kw).constraint()


def measure(target, draft, schemas, prompts, *, drafters=DRAFTERS, max_new_tokens: int = 96,
            repeats: int = 3) -> dict:
    """{drafter label: {speedup_unconstrained, speedup_constrained, kept, tau_...}} for one batch (one
    row per prompt; schemas[i] constrains row i)."""
    from jaxdecode import costmodel
    from jaxdecode.adaptive import default_widths
    from jaxdecode.autoregressive import decode
    from jaxdecode.drafters import make_drafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import policy_for, speculative_decode
    from jaxdecode.verifiers import get_verifier

    toks, lens = _prompts(target.tokenizer, prompts)
    constraint = constraint_for(target, list(schemas))
    cfg, params = target.config, target.params

    def per_token(run):
        out, secs = timed(lambda: _ready(run()), repeats)
        return out, secs / max(int(np.asarray(out.lengths).sum()), 1)

    greedy = {}
    for con in (None, constraint):
        greedy[con is None] = per_token(lambda: decode(cfg, params, toks, lens, max_new_tokens=max_new_tokens,
                                                       eos_ids=(0,), constraint=con, method="greedy"))
    result = {}
    for label, name, tree, needs_draft, adaptive in drafters:
        d = make_drafter(name, target, draft=draft if needs_draft else None, tree=tree)
        policy = costs = None
        if adaptive:  # as generate() does by default: costs measured once per drafter and batch (cached)
            widths = default_widths(d.num_nodes, tuple(getattr(d, "verify_widths", None) or ()))
            policy = policy_for(d, SamplerConfig(temperature=0.0), widths=widths)
            costs = costmodel.load_or_calibrate(target, d, int(toks.shape[0]), widths=widths,
                                                context_len=int(toks.shape[1]) + max_new_tokens // 2,
                                                sampler=SamplerConfig(temperature=0.0), verifier=get_verifier("greedy"))
        row = {}
        for con in (None, constraint):
            out, spt = per_token(lambda: speculative_decode(cfg, params, d, toks, lens, max_new_tokens=max_new_tokens,
                                                            verifier=get_verifier("greedy"), eos_ids=(0,),
                                                            constraint=con, adaptive=policy, costs=costs))
            ref = greedy[con is None][0]
            if not np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens)):
                raise AssertionError(f"{label}: speculative output differs from greedy "
                                     f"({'unconstrained' if con is None else 'constrained'})")
            key = "unconstrained" if con is None else "constrained"
            row[f"speedup_{key}"] = round(greedy[con is None][1] / spt, 3)
            row[f"tau_{key}"] = round(float(np.mean(np.asarray(out.stats["tau"]))), 3)
            row[f"ms_per_token_{key}"] = round(1e3 * spt, 4)
        row["kept"] = round(row["speedup_constrained"] / row["speedup_unconstrained"], 3)
        result[label] = row
        log(f"  {label}: {row}")
    return result


def _ready(out):
    np.asarray(out.tokens)  # block until the device is done
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, first drafter only (checks it runs)")
    ap.add_argument("--batch", default=None, help="batch sizes, comma separated")
    ap.add_argument("--new", type=int, default=None, help="max new tokens")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--workloads", default="code,records",
                    help="code: code prompts, JSON answers (nothing to copy); records: few-shot JSON lines; "
                         "anytext: held-out code under a regex every text matches (the machinery's own cost)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    batches = [int(b) for b in (args.batch or preset["batch"]).split(",")]
    new, repeats = args.new or preset["new"], args.repeats or preset["repeats"]

    import jax

    import jaxdecode
    from jaxdecode.model import embedded_model_path
    target = jaxdecode.load(embedded_model_path("target"), dtype="float32")
    draft = jaxdecode.load(embedded_model_path("draft"), dtype="float32")
    result = dict(device=jax.devices()[0].device_kind, max_new_tokens=new, repeats=repeats)
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown {workload!r}; choose from {', '.join(WORKLOADS)}")
        prompts, schemas = WORKLOADS[workload], SCHEMAS
        if workload == "anytext":
            from _common import heldout_prompts
            prompts = [target.tokenizer.decode(w) for w in heldout_prompts(target.tokenizer, len(SCHEMAS), 96)]
            schemas = [ANY_TEXT] * len(SCHEMAS)
        for b in batches:
            rows = [i % len(SCHEMAS) for i in range(b)]
            log(f"{workload}, batch {b}")
            key = f"batch{b}" if workload == "code" else f"{workload}_batch{b}"
            result[key] = measure(target, draft, [schemas[i] for i in rows], [prompts[i] for i in rows],
                                  drafters=DRAFTERS[:preset["drafters"]], max_new_tokens=new, repeats=repeats)
    write_result(result, args.json)


if __name__ == "__main__":
    main()
