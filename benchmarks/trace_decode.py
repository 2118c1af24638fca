"""Where a decode's time goes, op by op: a jax.profiler trace of `jaxdecode.generate` per method, summed
by compiled op, so a run on a lent accelerator comes back as a table and not only as a trace to open.

    python benchmarks/trace_decode.py [--method greedy --method speculative
                                       --method 'speculative:adaptive=false' ...] [--batch-size 1]
                                      [--temperature 0] [--prompts 4] [--max-new-tokens 128]
                                      [--calls 3] [--top 20] [--trace-dir DIR] [--json FILE]

Per method: each batch is called once untimed (compile, cost calibration), then `--calls` times in a
trace. The trace's ops that name a compiled op (`hlo_op`: XLA:CPU thunks, GPU kernels) are summed
per device process: how many ran per generated token, their total time against the calls' wall time
(the rest is launches, host round trips and idle device), and the `--top` ops by time. On a GPU, ops
per token times a launch of a few us is the floor a small model's step cannot go below. Methods are
written as `jaxdecode bench --method` takes them.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import heldout_prompts, write_result  # noqa: E402

import jaxdecode  # noqa: E402
from jaxdecode.bench import parse_method  # noqa: E402
from jaxdecode.model import embedded_model_path  # noqa: E402


def leaf_ops(events: list) -> list:
    """The op events that hold no other op event of their thread: a `while` or `conditional` thunk on the
    CPU spans the ops of its body, which would otherwise be counted twice."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    leaves = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack = []  # [event, holds another]: the spans open at this event's start
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0].get("dur", 0.0) <= e["ts"]:
                done, parent = stack.pop()
                if not parent:
                    leaves.append(done)
            if stack:
                stack[-1][1] = True
            stack.append([e, False])
        leaves += [e for e, parent in stack if not parent]
    return leaves


def device_ops(trace_file: Path) -> dict:
    """{process name: Counters of count and total microseconds per op} of the leaf events naming an
    hlo_op (compiled ops: XLA:CPU thunks, GPU kernels)."""
    data = json.load(gzip.open(trace_file))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_op")]
    out = collections.defaultdict(lambda: {"count": collections.Counter(), "us": collections.Counter()})
    for e in leaf_ops(ops):
        rec = out[procs.get(e.get("pid"), str(e.get("pid")))]
        rec["count"][e["args"]["hlo_op"]] += 1
        rec["us"][e["args"]["hlo_op"]] += float(e.get("dur", 0.0))
    return out


def trace_method(model, batches, name, options, calls, trace_dir: Path, top: int) -> dict:
    for batch in batches:  # compile and calibrate outside the trace
        jaxdecode.generate(model, batch, method=name, **options)
    new = 0
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(calls):
            for batch in batches:
                res = jaxdecode.generate(model, batch, method=name, **options)
                new += sum(r.stats["new_tokens"] for r in res)
        wall_us = (time.perf_counter() - t0) * 1e6
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}: the profiler wrote no trace")
    procs = device_ops(files[-1])
    row = dict(method=name, options={k: str(v) for k, v in options.items()}, new_tokens=new, wall_us=wall_us,
               wall_us_per_token=wall_us / max(new, 1), processes={})
    for proc, rec in procs.items():
        total_us, ops = sum(rec["us"].values()), sum(rec["count"].values())
        row["processes"][proc] = dict(
            ops_per_token=ops / max(new, 1), op_us_per_token=total_us / max(new, 1),
            busy=total_us / wall_us,
            top=[dict(op=op, us_per_token=us / max(new, 1), count_per_token=rec["count"][op] / max(new, 1))
                 for op, us in rec["us"].most_common(top)])
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded target)")
    ap.add_argument("--method", action="append", default=None,
                    help="a method as `jaxdecode bench --method` takes it (repeatable; default: greedy, "
                         "speculative, speculative:adaptive=false)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=3, help="traced calls per batch")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--trace-dir", default=None, help="keep the traces here (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.prompts < args.batch_size or args.calls < 1:
        raise SystemExit("--batch-size >= 1, --prompts >= --batch-size and --calls >= 1, please")
    methods = [parse_method(m) for m in (args.method or ["greedy", "speculative", "speculative:adaptive=false"])]
    model = jaxdecode.load(args.target or embedded_model_path("target"), dtype="float32")
    prompts = heldout_prompts(model.tokenizer, args.prompts, args.prompt_tokens)
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts) - args.batch_size + 1, args.batch_size)]
    root = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxdecode_trace_"))
    rows = []
    for i, (name, options) in enumerate(methods):
        common = dict(max_new_tokens=args.max_new_tokens)
        if args.temperature > 0:  # plain decoding's counterpart at a temperature is sampling
            name = "sample" if name == "greedy" else name
            common.update(temperature=args.temperature, seed=0)
        row = trace_method(model, batches, name, {**common, **options}, args.calls, root / f"{i}_{name}", args.top)
        rows.append(row)
        print(f"\n{name} {row['options']}: {row['wall_us_per_token']:.1f} us per token (wall)")
        for proc, p in row["processes"].items():
            print(f"  {proc}: {p['ops_per_token']:.1f} ops / token, {p['op_us_per_token']:.1f} us of ops / token "
                  f"({p['busy']:.0%} of the wall time)")
            for t in p["top"]:
                print(f"    {t['us_per_token']:8.1f} us  {t['count_per_token']:6.2f} x  {t['op']}")
    write_result(dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                      args=vars(args), trace_dir=str(root), rows=rows), args.json)


if __name__ == "__main__":
    main()
