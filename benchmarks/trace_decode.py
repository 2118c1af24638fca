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

Each top op also says where it came from (`where`): run as a script, XLA dumps the compiled programs'
HLO (`--xla_dump_to`, set before JAX starts), and an op's source is its stack frame there
(file:function:line); an op that wraps others (a GPU command buffer, a loop, a call) lists the
functions most of its ops came from. A GPU profile names ops like `command_buffer_850`: this is how
it names the code behind them.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # XLA reads its flags once, when JAX starts: dump the compiled programs here
    HLO_DIR = tempfile.mkdtemp(prefix="jaxdecode_hlo_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={HLO_DIR} --xla_dump_hlo_as_text"
else:
    HLO_DIR = None

import jax  # noqa: E402

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
    """{process name: Counters of count and total microseconds per (module, op)} of the leaf events
    naming an hlo_op (compiled ops: XLA:CPU thunks, GPU kernels)."""
    data = json.load(gzip.open(trace_file))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_op")]
    out = collections.defaultdict(lambda: {"count": collections.Counter(), "us": collections.Counter()})
    for e in leaf_ops(ops):
        rec = out[procs.get(e.get("pid"), str(e.get("pid")))]
        key = (e["args"].get("hlo_module", ""), e["args"]["hlo_op"])
        rec["count"][key] += 1
        rec["us"][key] += float(e.get("dur", 0.0))
    return out


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")


def dumped_programs(dump_dir) -> list:
    """The compiled programs XLA dumped so far (`*after_optimizations.txt`), oldest first."""
    return sorted(Path(dump_dir).glob("*after_optimizations.txt")) if dump_dir else []


class HloSources:
    """Where the ops of XLA's dumped programs came from: per (module, op), the source of the op's stack
    frame, or for an op that runs other computations the functions most of their ops came from.
    `where(module, op)` is "" for what the dump does not hold. A profile names an op by module and op
    name only, and a module compiled twice (the adaptive and the fixed engine are both
    `jit__speculative`) reuses op names: of `paths`, the first that holds a module is read for it,
    so pass the programs the traced calls compiled first."""

    def __init__(self, paths):
        self.ops = collections.defaultdict(dict)  # module -> op -> (location or None, called, operands)
        self.comps = collections.defaultdict(dict)  # module -> computation -> [op names]
        for path in paths:
            self._read(Path(path))

    def _read(self, path: Path):
        module, tables, section, comp = None, {t: {} for t in _TABLES}, None, None
        ops, comps = {}, collections.defaultdict(list)
        for line in path.read_text().splitlines():
            if line.startswith("HloModule "):
                module = line.split()[1].rstrip(",")
                continue
            if line in _TABLES:
                section = line
                continue
            if section and re.match(r"\d+ ", line):
                num, rest = line.split(" ", 1)
                tables[section][int(num)] = rest
                continue
            section = None
            head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
            if head and not line.startswith(" "):
                comp = head.group(1)
                continue
            ins = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = ", line)
            if ins and comp:
                frame = re.search(r"stack_frame_id=(\d+)", line)
                args = re.search(r" [\w\-]+\(([^)]*)\)", line[ins.end():])  # the op's operands
                operands = re.findall(r"%([\w.\-]+)", args.group(1)) if args else []
                ops[ins.group(1)] = (int(frame.group(1)) if frame else None, _CALLED.findall(line), operands)
                comps[comp].append(ins.group(1))
        if module is None or module in self.ops:
            return
        files = {i: v.strip('"').rsplit("/", 1)[-1] for i, v in tables["FileNames"].items()}
        funcs = {i: v.strip('"') for i, v in tables["FunctionNames"].items()}
        locs = {}
        for i, v in tables["FileLocations"].items():
            f = {k: int(n) for k, n in re.findall(r"(\w+)=(\d+)", v)}
            file, func = files.get(f.get("file_name_id"), "?"), funcs.get(f.get("function_name_id"), "?")
            locs[i] = f"{file}:{func}:{f.get('line', '?')}"
        frames = {i: locs.get(int(dict(re.findall(r"(\w+)=(\d+)", v)).get("file_location_id", 0)), "")
                  for i, v in tables["StackFrames"].items()}  # the frame's own location (its callers: not read)
        self.ops[module] = {op: (frames.get(frame) if frame else None, called, operands)
                            for op, (frame, called, operands) in ops.items()}
        self.comps[module] = dict(comps)

    def _locations(self, module, op, depth=0) -> collections.Counter:
        loc, called, _ = self.ops[module].get(op, (None, [], []))
        if loc:
            return collections.Counter({loc.rsplit(":", 1)[0]: 1})
        out = collections.Counter()
        if depth < 4:
            for c in called:
                for name in self.comps[module].get(c, []):
                    out += self._locations(module, name, depth + 1)
        return out

    def where(self, module, op, most: int = 3) -> str:
        if module not in self.ops:
            return ""
        names = [op, re.sub(r"_(\d+)$", r".\1", op)]  # a profile's command_buffer_850: command_buffer.850
        for name in names:
            if name in self.ops[module]:
                loc, called, operands = self.ops[module][name]
                if loc:
                    return loc
                if called:
                    return "; ".join(f"{k} x{n}" for k, n in self._locations(module, name).most_common(most))
                for x in operands:  # an op XLA made (a dot split off a fusion): where its inputs came from
                    if self.ops[module].get(x, (None,))[0]:
                        return "near " + self.ops[module][x][0]
                return ""
            if name in self.comps[module]:  # a computation named like the op (what a thunk runs)
                c = collections.Counter()
                for inner in self.comps[module][name]:
                    c += self._locations(module, inner)
                return "; ".join(f"{k} x{n}" for k, n in c.most_common(most))
        return ""


def source_key(where: str) -> str:
    """The function an op is charged to: the first (most common) source, without its line."""
    first = where.split(";")[0].strip().removeprefix("near ")
    first = re.sub(r" x\d+$", "", first)
    return first.rsplit(":", 1)[0] if first.count(":") >= 2 else (first or "?")


def by_source(rec, sources, new: int, top: int) -> list:
    """Ops per token and their time, summed by the function they came from (`source_key`)."""
    count, us = collections.Counter(), collections.Counter()
    for key, t in rec["us"].items():
        src = source_key(sources.where(*key))
        count[src] += rec["count"][key]
        us[src] += t
    return [dict(source=src, ops_per_token=count[src] / max(new, 1), us_per_token=t / max(new, 1))
            for src, t in us.most_common(top)]


def trace_method(model, batches, name, options, calls, trace_dir: Path, top: int) -> dict:
    before = dumped_programs(HLO_DIR)
    for batch in batches:  # compile and calibrate outside the trace
        jaxdecode.generate(model, batch, method=name, **options)
    # This method's programs first (what it compiled now), then those it may reuse from earlier methods.
    seen = set(before)
    sources = HloSources([p for p in dumped_programs(HLO_DIR) if p not in seen] + before[::-1])
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
            top=[dict(op=op, module=module, where=sources.where(module, op), us_per_token=us / max(new, 1),
                      count_per_token=rec["count"][(module, op)] / max(new, 1))
                 for (module, op), us in rec["us"].most_common(top)],
            by_source=by_source(rec, sources, new, top))
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
                print(f"    {t['us_per_token']:8.1f} us  {t['count_per_token']:6.2f} x  {t['op']}"
                      + (f"  [{t['where']}]" if t["where"] else ""))
            print("  by source (function):")
            for t in p["by_source"]:
                print(f"    {t['us_per_token']:8.1f} us  {t['ops_per_token']:6.2f} ops  {t['source']}")
    write_result(dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                      args=vars(args), trace_dir=str(root), hlo_dir=HLO_DIR, rows=rows), args.json)


if __name__ == "__main__":
    main()
