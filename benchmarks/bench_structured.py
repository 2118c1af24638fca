"""Structured output (regex / JSON schema) against the peers installed from PyPI, one run.

Schemas: the JSON-Schema-Test-Suite, draft 2020-12 (benchmarks/data/json_schema_test_suite, MIT): each case
is a schema with instances marked valid / invalid. Peers: outlines-core (the library jaxdecode compiles
with), xgrammar, llguidance; the tokenizer is the embedded target's (byte-level BPE, V = 4096).

Sections (--sections, default all):
  compile   per schema and system: compiles?  (jaxdecode refuses keywords it cannot enforce with an error
            naming them; outlines-core's converter drops some silently), compile time.
  accept    token level, for every instance of the suite: the instance as json.dumps text, tokenized; a
            system ACCEPTS it when every token is allowed in turn and EOS is allowed at the end. Counted:
            invalid instances accepted (wrong), valid ones rejected (incomplete, e.g. whitespace or
            keywords the system cannot express).
  generate  the embedded target decodes greedily under each schema jaxdecode compiled (rows of a batch
            with different schemas: stacked automata); each output is checked with jsonschema.
            invalid = ended with EOS but does not validate (goal 0); unfinished = no EOS within the budget.
  mask      per-token mask cost (mask + advance, µs per step) along valid instances (two realistic
            workload schemas with ~90-token instances, then the suite's longest): jaxdecode's device mask
            (jitted scan, batch 1) vs each peer's host mask fill into its bitmask; at V = 4096 and, with
            --vocab32k, a BPE tokenizer trained here to 32k tokens on the stdlib (workloads only).
  overhead  a greedy decode step of the embedded target with and without a constraint (regex, every row
            forced to run all steps), batch 1 and 16 (goal: <= 5%).
  spec      constrained speculative decoding (prompt lookup, default adaptive) against constrained greedy,
            and the same unconstrained: the fraction of the speedup kept (goal >= 80%).

    python benchmarks/bench_structured.py --quick                 # a few schemas, small sizes (checks it runs)
    python benchmarks/bench_structured.py --out structured.json   # the full run
    python benchmarks/bench_structured.py --limit 100 --sections compile,accept,mask --vocab32k
    python benchmarks/bench_structured.py --limit 0 --sections compile,accept   # the whole suite, a case at a time

compile and accept alone (no later section needs the compiled handles) run a case at a time, each
(case, system) pair in that system's worker process (the tokenizer loaded once per worker), under a
budget: --case-timeout seconds (default 60) and --case-memory-gb of resident memory (default 6). A pair
past it is killed, counted not compiled, and its reason kept (compile.<system>.failures: refused /
error / timeout / memory / crashed; errors: the text per case). Schemas without a type (any JSON value)
are the ones that need it: outlines-core's index over them takes minutes and ~11 GB at V = 4096.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_seconds, write_result  # noqa: E402

SUITE = Path(__file__).resolve().parent / "data" / "json_schema_test_suite" / "draft2020-12"
SECTIONS = ("compile", "accept", "generate", "mask", "overhead", "spec")
PEERS = ("jaxdecode", "outlines-core", "xgrammar", "llguidance")
QUICK = dict(limit=8, max_new_tokens=32, batch=4, mask_schemas=3, steps=16, repeats=2, spec_batch=1)
# --quick: cases of these files only (small schemas: outlines-core compiles `{}` sub-schemas slowly)
QUICK_FILES = ("type", "enum", "const", "required", "maxLength", "minimum")
FULL = dict(limit=0, max_new_tokens=160, batch=16, mask_schemas=30, steps=64, repeats=5, spec_batch=4)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the suite
def load_suite(limit: int, files=None) -> list[dict]:
    """Cases {name, schema, tests: [(data, valid)]}, in file then case order; limit 0 = all; files: only
    these stems (cases taken round robin over them)."""
    cases = []
    paths = sorted(SUITE.glob("*.json"))
    if files:
        paths = [p for p in paths if p.stem in files]
    for path in paths:
        for i, case in enumerate(json.loads(path.read_text())):
            cases.append(dict(name=f"{path.stem}/{i}", schema=case["schema"],
                              tests=[(t["data"], bool(t["valid"])) for t in case["tests"]]))
    if files:  # round robin: a few cases of each file
        by_file = [[c for c in cases if c["name"].startswith(p.stem + "/")] for p in paths]
        cases = [c for group in zip(*by_file) for c in group] if by_file else []
    return cases[:limit] if limit else cases


# ----------------------------------------------------------------------------- the systems
class System:
    """One structured-output library over one tokenizer: compile(schema) -> handle, accepts(handle,
    ids) -> bool, mask_walk(handle, ids) -> seconds per step (mask fill + advance)."""
    name = ""


class Jaxdecode(System):
    name = "jaxdecode"

    def __init__(self, tokenizer, vocab_size, eos):
        self.tok, self.v, self.eos = tokenizer, vocab_size, eos

    def compile(self, schema):
        from jaxdecode.constraints.automaton import compile_json_schema
        return compile_json_schema(schema, self.tok, vocab_size=self.v, eos_ids=(self.eos,))

    def accepts(self, auto, ids):
        s = auto.walk(ids)
        return s >= 0 and bool(auto.final[s])

    def mask_walk(self, auto, ids, repeats):
        """Device: a jitted scan of `allowed` + `advance` along ids at batch 1 (compile excluded)."""
        import jax
        import jax.numpy as jnp
        c = auto.constraint().prepare(self.v, (self.eos,))

        @jax.jit
        def walk(c, toks):
            def step(st, t):
                m = c.allowed(st, self.v)
                return c.advance(st, t[None]), m.sum()
            return jax.lax.scan(step, c.init(1), toks)[1]
        toks = jnp.asarray(ids, jnp.int32)
        jax.block_until_ready(walk(c, toks))
        return median_seconds(lambda: jax.block_until_ready(walk(c, toks)), repeats) / len(ids)


class OutlinesCore(System):
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size, eos):
        import outlines_core
        from jaxdecode.constraints.automaton import token_bytes
        mapping = {}
        for i, b in enumerate(token_bytes(tokenizer)):
            if b and i != eos:
                mapping.setdefault(b, []).append(i)
        self.oc, self.v, self.eos = outlines_core, vocab_size, eos
        self.vocab = outlines_core.Vocabulary(eos, mapping)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def accepts(self, index, ids):
        g = self.oc.Guide(index)
        try:
            for t in ids:
                g.advance(t)
        except Exception:  # noqa: BLE001 - a forbidden token
            return False
        return self.eos in g.get_tokens()

    def mask_walk(self, index, ids, repeats):
        mask = np.zeros((self.v + 31) // 32, np.int32)

        def run():
            g = self.oc.Guide(index)
            for t in ids:
                g.write_mask_into(mask.ctypes.data, mask.size, 4)
                g.advance(t)
        return median_seconds(run, repeats, warmup=1) / len(ids)


class XGrammar(System):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos):
        import xgrammar
        self.xgr, self.v, self.eos = xgrammar, vocab_size, eos
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def accepts(self, compiled, ids):
        m = self.xgr.GrammarMatcher(compiled)
        return all(m.accept_token(int(t)) for t in ids) and m.accept_token(self.eos)

    def mask_walk(self, compiled, ids, repeats):
        bitmask = self.xgr.allocate_token_bitmask(1, self.v)

        def run():
            m = self.xgr.GrammarMatcher(compiled)
            for t in ids:
                m.fill_next_token_bitmask(bitmask)
                m.accept_token(int(t))
        return median_seconds(run, repeats, warmup=1) / len(ids)


class LLGuidance(System):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.llg, self.v, self.eos = llguidance, vocab_size, eos
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def accepts(self, grammar, ids):
        m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        return bool(m.consume_tokens([int(t) for t in ids])) and not m.is_error() and m.is_accepting()

    def mask_walk(self, grammar, ids, repeats):
        fill = self.llg.numpy.fill_next_token_bitmask
        bitmask = self.llg.numpy.allocate_token_bitmask(1, self.v)

        def run():
            m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
            for t in ids:
                fill(m, bitmask, 0)
                m.consume_token(int(t))
        return median_seconds(run, repeats, warmup=1) / len(ids)


SYSTEM_CLASSES = (Jaxdecode, OutlinesCore, XGrammar, LLGuidance)


def make_systems(tokenizer, vocab_size, eos) -> dict:
    out = {}
    for cls in SYSTEM_CLASSES:
        try:
            out[cls.name] = cls(tokenizer, vocab_size, eos)
        except ImportError as e:
            log(f"{cls.name}: not installed ({e}); left out")
    return out


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


# ----------------------------------------------------------------------------- sections
def section_compile(cases, systems) -> tuple[dict, dict]:
    """(compiled handles {system: {case index: handle}}, the section's result)."""
    handles = {s: {} for s in systems}
    times = {s: [] for s in systems}
    errors = {s: {} for s in systems}
    for i, case in enumerate(cases):
        for name, sys_ in systems.items():
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    handles[name][i] = sys_.compile(case["schema"])
                times[name].append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - every failure is counted, with its reason
                errors[name][case["name"]] = first_line(e)
        if (i + 1) % 25 == 0:
            log(f"  compile: {i + 1}/{len(cases)} schemas")
    n = len(cases)
    result = {name: dict(compiled=len(handles[name]), of=n, fraction=round(len(handles[name]) / max(n, 1), 3),
                         compile_ms_median=round(1e3 * statistics.median(times[name]), 3) if times[name] else None,
                         compile_ms_max=round(1e3 * max(times[name]), 3) if times[name] else None,
                         errors=errors[name]) for name in systems}
    return handles, result


def section_accept(cases, systems, handles, tokenizer) -> dict:
    out = {}
    for name, sys_ in systems.items():
        c = dict(invalid=0, invalid_accepted=0, valid=0, valid_rejected=0)
        wrong = []
        for i, case in enumerate(cases):
            if i not in handles[name]:
                continue
            for data, valid in case["tests"]:
                ids = tokenizer.encode(json.dumps(data), add_special_tokens=False)
                ok = sys_.accepts(handles[name][i], ids)
                if valid:
                    c["valid"] += 1
                    c["valid_rejected"] += int(not ok)
                else:
                    c["invalid"] += 1
                    c["invalid_accepted"] += int(ok)
                    if ok:
                        wrong.append(f"{case['name']}: {json.dumps(data)[:60]}")
        c["invalid_accepted_fraction"] = round(c["invalid_accepted"] / max(c["invalid"], 1), 3)
        c["examples_invalid_accepted"] = wrong[:10]
        out[name] = c
    return out


# ----------------------------------------------------------------------------- per-case budget (workers)
# A schema whose index build explodes (a schema without a type is any JSON value: outlines-core's index
# over it took minutes and ~11 GB at V = 4096) must cost its (case, system) pair, not the run. So each
# system compiles and accepts in its own worker process, reused case after case while it is healthy, and
# killed past a wall-clock or resident-memory budget (then restarted; the pair is "not compiled").
# RSS is watched from the parent rather than capped with RLIMIT_AS: under a cap the failure surfaces
# inside the library (Rust aborts the process on a failed allocation, C++ throws), indistinguishable from
# a crash, while a parent that kills at the budget knows the reason; and RSS is what fills the machine.
REASONS = ("refused", "error", "timeout", "memory", "crashed")
_REFUSAL_WORDS = ("unimplemented", "not supported", "unsupported", "not implemented")


def _classify(name: str, schema, error: str) -> str:
    """'refused': the system declines a keyword / feature it cannot enforce (jaxdecode: check_schema
    rejects the schema; a peer's message says unsupported / unimplemented); 'error': anything else."""
    if name == "jaxdecode":
        from jaxdecode.constraints.automaton import check_schema
        try:
            check_schema(schema)
        except Exception:  # noqa: BLE001 - the refusal itself
            return "refused"
        return "error"
    return "refused" if any(w in error.lower() for w in _REFUSAL_WORDS) else "error"


def _case_worker(conn, name: str, model_path: str, vocab_size: int, eos: int) -> None:
    """Worker process: the tokenizer and one system built once, then (case -> compile, accept) until
    None. Sends ('ready', None) | ('init_error', text), then per case ('compiled', dict) and
    ('accepted', dict | None)."""
    import gc
    try:
        from jaxdecode.models import load_tokenizer
        tok = load_tokenizer(model_path)
        sys_ = {c.name: c for c in SYSTEM_CLASSES}[name](tok, vocab_size, eos)
    except Exception as e:  # noqa: BLE001 - e.g. a peer not installed: reported, the system left out
        conn.send(("init_error", first_line(e)))
        return
    conn.send(("ready", None))
    while True:
        case = conn.recv()
        if case is None:
            return
        handles, r = section_compile([case], {name: sys_})
        r = r[name]
        err = r["errors"].get(case["name"])
        conn.send(("compiled", dict(ok=bool(r["compiled"]), ms=r["compile_ms_median"], error=err,
                                    reason=None if err is None else _classify(name, case["schema"], err))))
        acc = section_accept([case], {name: sys_}, handles, tok)[name] if r["compiled"] else None
        conn.send(("accepted", acc))
        del handles
        gc.collect()


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CaseWorker:
    """One system's worker process, with the budget of the case it is running (see _case_worker)."""

    def __init__(self, name, model_path, vocab_size, eos):
        import multiprocessing
        self.name, self.args = name, (name, str(model_path), int(vocab_size), int(eos))
        self.ctx = multiprocessing.get_context("spawn")  # no fork of a parent that has JAX threads
        self.proc = self.conn = None
        self.task = None  # (case index, case, start time, compiled message)
        self.restarts = 0
        self.start()

    def start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_case_worker, args=(child,) + self.args, daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout=600.0) -> str | None:
        """None when ready, else why not (the system is then left out). timeout 0: do not wait (then
        'starting' while it starts)."""
        if self.ready:
            return None
        if not timeout and not self.conn.poll():
            return "starting"
        if not self.conn.poll(timeout):
            self.kill()
            return f"worker did not start within {timeout:.0f} s"
        try:
            kind, text = self.conn.recv()
        except EOFError:
            return f"worker died while starting (exit code {self.proc.exitcode})"
        self.ready = kind == "ready"
        return None if self.ready else text

    def submit(self, i, case):
        err = self.wait_ready()
        if err:
            raise RuntimeError(f"{self.name}: {err}")
        self.conn.send(case)
        self.task = [i, case, time.perf_counter(), None]

    def kill(self):
        self.proc.kill()
        self.proc.join()
        self.conn.close()

    def poll(self, timeout_s: float, memory_bytes: int):
        """None while the case runs; else (case index, outcome dict) and the worker is free again."""
        i, case, t0, compiled = self.task
        try:
            while self.conn.poll():
                kind, payload = self.conn.recv()
                if kind == "compiled":
                    self.task[3] = compiled = payload
                elif kind == "accepted":
                    self.task = None
                    return i, dict(compiled, accept=payload)
        except (EOFError, OSError):
            return self._fail(i, "crashed", f"the worker died (exit code {self.proc.exitcode})", compiled)
        if not self.proc.is_alive():
            return self._fail(i, "crashed", f"the worker died (exit code {self.proc.exitcode})", compiled)
        elapsed = time.perf_counter() - t0
        if timeout_s and elapsed > timeout_s:
            return self._fail(i, "timeout", f"no result within the {timeout_s:g} s budget", compiled)
        rss = _rss_bytes(self.proc.pid)
        if memory_bytes and rss > memory_bytes:
            return self._fail(i, "memory", f"resident memory {rss / 2**30:.1f} GB passed the "
                                           f"{memory_bytes / 2**30:g} GB budget after {elapsed:.0f} s", compiled)
        return None

    def _fail(self, i, reason, text, compiled):
        stage = "accepting" if compiled else "compiling"
        self.kill()
        self.task = None
        self.restarts += 1
        self.start()  # the next case gets a fresh worker (it starts while others run)
        return i, dict(ok=False, ms=None, error=f"{reason} while {stage}: {text}", reason=reason, accept=None)

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


def section_compile_accept_budget(cases, names, model_path, vocab_size, eos, args,
                                  checkpoint=None) -> tuple[dict, dict]:
    """The compile and accept sections' results (same fields and meaning), one case at a time (memory
    stays one case's worth: the whole suite's indices held together outgrew 24 GB at case ~150), each
    (case, system) pair run in that system's worker under the budget (--case-timeout seconds of compile
    + accept, --case-memory-gb of resident memory): a pair past it is killed and counted as not compiled,
    its reason kept. --jobs pairs run at once (different systems; 1 = one at a time). checkpoint(comp,
    acc, cases done) is called every 10 finished cases (a long run leaves its partial results)."""
    workers = {}
    for name in names:
        w = CaseWorker(name, model_path, vocab_size, eos)
        err = w.wait_ready()
        if err:
            log(f"{name}: left out ({err})")
            w.close()
            continue
        workers[name] = w
    mem = int(args.case_memory_gb * 2**30)
    comp = {name: dict(compiled=0, of=len(cases), times=[], errors={}, failures=dict.fromkeys(REASONS, 0))
            for name in workers}
    acc = {name: dict(invalid=0, invalid_accepted=0, valid=0, valid_rejected=0, examples_invalid_accepted=[])
           for name in workers}
    todo = {name: list(range(len(cases))) for name in workers}  # each worker runs its cases in order
    done_cases = dict.fromkeys(range(len(cases)), 0)
    failed_starts = dict.fromkeys(workers, 0)
    t_start, finished = time.perf_counter(), 0
    try:
        while any(todo.values()) or any(w.task for w in workers.values()):
            busy = sum(w.task is not None for w in workers.values())
            # start the worker furthest behind first, so systems stay on the same cases
            for name in sorted(workers, key=lambda n: -len(todo[n])):
                w = workers[name]
                if busy >= args.jobs or w.task is not None or not todo[name]:
                    continue
                err = w.wait_ready(0)  # never block: other workers' budgets are being watched
                if err == "starting":
                    continue
                if err:  # a restarted worker that failed to start (e.g. a source file caught mid-edit): retry
                    failed_starts[name] += 1
                    log(f"  {name}: worker restart failed ({err}); attempt {failed_starts[name]} of 5")
                    if failed_starts[name] >= 5:
                        raise RuntimeError(f"{name}: its worker failed to start 5 times in a row: {err}")
                    time.sleep(5)
                    w.start()
                    continue
                failed_starts[name] = 0
                i = todo[name].pop(0)
                w.submit(i, cases[i])
                busy += 1
            time.sleep(0.05)
            for name, w in workers.items():
                if w.task is None:
                    continue
                out = w.poll(args.case_timeout, mem)
                if out is None:
                    continue
                i, r = out
                case = cases[i]
                if r["ok"]:
                    comp[name]["compiled"] += 1
                    comp[name]["times"].append(r["ms"])
                    for k in ("invalid", "invalid_accepted", "valid", "valid_rejected"):
                        acc[name][k] += r["accept"][k]
                    acc[name]["examples_invalid_accepted"] += r["accept"]["examples_invalid_accepted"]
                else:
                    comp[name]["errors"][case["name"]] = r["error"]
                    comp[name]["failures"][r["reason"]] += 1
                    if r["reason"] in ("timeout", "memory", "crashed"):
                        log(f"  {case['name']} {name}: {r['error']}")
                done_cases[i] += 1
                if done_cases[i] == len(workers):
                    finished += 1
                    if finished % 25 == 0 or finished == len(cases):
                        log(f"  compile + accept: {finished}/{len(cases)} schemas, "
                            f"{time.perf_counter() - t_start:.0f} s")
                    if checkpoint is not None and finished % 10 == 0:
                        checkpoint(*_budget_summary(comp, acc, workers, len(cases), args), finished)
    finally:
        for w in workers.values():
            w.close()
    return _budget_summary(comp, acc, workers, len(cases), args)


def _budget_summary(comp, acc, workers, n, args) -> tuple[dict, dict]:
    """The running tallies as the sections' result dicts (copies: the tallies go on)."""
    c_out, a_out = {}, {}
    for name in comp:
        c = dict(comp[name], errors=dict(comp[name]["errors"]), failures=dict(comp[name]["failures"]))
        t = c.pop("times")
        c.update(fraction=round(c["compiled"] / max(n, 1), 3),
                 compile_ms_median=round(statistics.median(t), 3) if t else None,
                 compile_ms_max=round(max(t), 3) if t else None, worker_restarts=workers[name].restarts,
                 budget=dict(case_timeout_s=args.case_timeout, case_memory_gb=args.case_memory_gb))
        c_out[name] = c
        a = dict(acc[name])
        a["invalid_accepted_fraction"] = round(a["invalid_accepted"] / max(a["invalid"], 1), 3)
        a["examples_invalid_accepted"] = a["examples_invalid_accepted"][:10]
        a_out[name] = a
    return c_out, a_out


def _validates(schema, text) -> bool | None:
    import jsonschema
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return cls(schema).is_valid(instance)
    except Exception:  # noqa: BLE001 - e.g. a remote $ref the validator cannot fetch
        return None


def section_generate(cases, handles, model, args) -> dict:
    import jaxdecode
    from jaxdecode.structured import output_text
    todo = sorted(handles["jaxdecode"])
    counts = dict(schemas=len(todo), finished=0, valid=0, invalid=0, unfinished=0, unknown=0)
    invalid_examples, seconds = [], 0.0
    for start in range(0, len(todo), args.batch):
        rows = todo[start:start + args.batch]
        t0 = time.perf_counter()
        out = jaxdecode.generate(model, ["value = "] * len(rows), max_new_tokens=args.max_new_tokens,
                                 json_schema=[cases[i]["schema"] for i in rows])
        seconds += time.perf_counter() - t0
        for i, r in zip(rows, out):
            if r.tokens[-1] not in model.config.eos_token_ids:
                counts["unfinished"] += 1
                continue
            counts["finished"] += 1
            ok = _validates(cases[i]["schema"], output_text(model, r.tokens, model.config.eos_token_ids))
            key = {True: "valid", False: "invalid", None: "unknown"}[ok]
            counts[key] += 1
            if ok is False:
                invalid_examples.append(f"{cases[i]['name']}: {r.text[:80]}")
        log(f"  generate: {start + len(rows)}/{len(todo)} schemas")
    return dict(counts, seconds=round(seconds, 2), max_new_tokens=args.max_new_tokens,
                examples_invalid=invalid_examples[:10])


# Realistic schemas with long instances for the mask section (the suite's instances are a few tokens:
# a walk that short times call overheads, not masks).
_PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}, "active": {"type": "boolean"},
    "emails": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["street", "city", "zip"]}},
    "required": ["name", "age", "active", "emails", "address"]}
_ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}}},
    "required": ["id", "status", "items"]}
WORKLOADS = [
    dict(name="workload/person", schema=_PERSON, tests=[({
        "name": "Ada Lovelace", "age": 36, "active": True, "emails": ["ada@example.org", "countess@example.com"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"}}, True)]),
    dict(name="workload/order", schema=_ORDER, tests=[({
        "id": 90210, "status": "paid", "items": [{"sku": "A-100", "qty": 2, "price": 9.99},
                                                 {"sku": "B-7", "qty": 1, "price": 120.5},
                                                 {"sku": "C-33", "qty": 12, "price": 0.25}]}, True)]),
]


def _walks(cases, systems, handles, tokenizer, n):
    """Up to n (case, token ids) pairs: valid instances every compiled system accepts, longest first."""
    pairs = []
    for i, case in enumerate(cases):
        if not all(i in handles[s] for s in systems):
            continue
        for data, valid in case["tests"]:
            ids = tokenizer.encode(json.dumps(data), add_special_tokens=False)
            if valid and len(ids) >= 2 and all(systems[s].accepts(handles[s][i], ids) for s in systems):
                pairs.append((i, ids))
                break
    pairs.sort(key=lambda p: -len(p[1]))
    return pairs[:n]


def section_mask(cases, systems, handles, tokenizer, args, label) -> dict:
    """Walks of the workload schemas' instances, then the suite's longest valid instances."""
    work, _ = section_compile(WORKLOADS, systems)
    walks = [(handles, cases, p) for p in _walks(cases, systems, handles, tokenizer, args.mask_schemas)]
    walks = [(work, WORKLOADS, p) for p in _walks(WORKLOADS, systems, work, tokenizer, len(WORKLOADS))] + walks
    if len(walks) < 2:
        log(f"  mask ({label}): workload instances not accepted by every system: {[w[2][0] for w in walks]}")
    out = {"walks": len(walks), "tokens": sum(len(p[1]) for *_, p in walks),
           "workload_tokens": [len(p[1]) for h, c, p in walks if c is WORKLOADS]}
    for name, sys_ in systems.items():
        per = [sys_.mask_walk(h[name][i], ids, args.repeats) for h, c, (i, ids) in walks]
        out[name] = dict(us_per_step_median=round(1e6 * statistics.median(per), 2) if per else None,
                         us_per_step_max=round(1e6 * max(per), 2) if per else None,
                         us_per_step_workloads=[round(1e6 * x, 2) for x, (h, c, p) in zip(per, walks)
                                                if c is WORKLOADS])
    log(f"  mask ({label}): " + ", ".join(f"{k} {v['us_per_step_median']} us" for k, v in out.items()
                                          if isinstance(v, dict)))
    return out


def section_overhead(model, args) -> dict:
    """Greedy decode steps with and without a constraint that keeps every row going all steps."""
    import jax
    import jax.numpy as jnp

    from jaxdecode.autoregressive import decode
    from jaxdecode.constraints.automaton import compile_regex
    from jaxdecode.sampling import SamplerConfig
    steps = args.steps
    # every row must run all steps: more characters than `steps` tokens can hold, and no EOS before
    auto = compile_regex(f"[a-z ]{{{32 * steps}}}", model.tokenizer, vocab_size=model.config.vocab_size,
                         eos_ids=model.config.eos_token_ids)
    prompt = model.encode("def parse(self, text):\n    ")
    out = {}
    for b in (1, 16):
        toks = jnp.asarray([prompt] * b, jnp.int32)
        lens = jnp.full((b,), len(prompt), jnp.int32)

        def run(constraint):
            o = decode(model.config, model.params, toks, lens, max_new_tokens=steps, method="greedy",
                       sampler=SamplerConfig(temperature=0.0), eos_ids=(), constraint=constraint)
            jax.block_until_ready(o.tokens)
            return o
        c = auto.constraint()
        assert int(np.min(run(c).lengths)) == steps  # every row ran every step
        run(None)
        plain = median_seconds(lambda: run(None), args.repeats) / steps
        constrained = median_seconds(lambda: run(c), args.repeats) / steps
        out[f"batch{b}"] = dict(ms_per_step_plain=round(1e3 * plain, 4), ms_per_step_constrained=round(1e3 * constrained, 4),
                                overhead=round(constrained / plain - 1, 4))
        log(f"  overhead batch {b}: {out[f'batch{b}']}")
    return out


def section_spec(cases, handles, model, args) -> dict:
    """The spec helper's measurement (bench_structured_spec.measure: prompt lookup and the draft LM, output
    checked token for token against constrained greedy) on its schemas, else constrained speculative vs
    constrained greedy through generate on the suite's schemas."""
    import jaxdecode
    from jaxdecode.options import STRUCTURED
    if "speculative" not in STRUCTURED:
        return {"skipped": "method speculative does not take json_schema= in this build"}
    try:
        import bench_structured_spec as spec_bench
    except ImportError:
        spec_bench = None
    if spec_bench is not None:
        draft = jaxdecode.load("draft")
        rows = [i % len(spec_bench.SCHEMAS) for i in range(args.spec_batch)]
        drafters = spec_bench.DRAFTERS[:1] if args.quick else spec_bench.DRAFTERS
        return dict(source="bench_structured_spec.measure", batch=args.spec_batch,
                    drafters=spec_bench.measure(model, draft, [spec_bench.SCHEMAS[i] for i in rows],
                                                [spec_bench.PROMPTS[i] for i in rows], drafters=drafters,
                                                max_new_tokens=args.max_new_tokens, repeats=args.repeats))
    todo = sorted(handles["jaxdecode"])[: args.spec_batch]
    schemas = [cases[i]["schema"] for i in todo]
    prompts = ["value = "] * len(schemas)
    times = {}
    for label, method, kw in (("greedy", "greedy", {}), ("spec", "speculative", {"drafter": "prompt_lookup"})):
        for constrained in (False, True):
            extra = dict(kw, json_schema=schemas) if constrained else kw
            for _ in range(2):  # the first call compiles (and calibrates)
                res = jaxdecode.generate(model, prompts, method=method, max_new_tokens=args.max_new_tokens, **extra)
            tokens = sum(r.stats["new_tokens"] for r in res)
            times[(label, constrained)] = res[0].batch_stats["seconds"] / max(tokens, 1)
    plain = times[("greedy", False)] / times[("spec", False)]
    cons = times[("greedy", True)] / times[("spec", True)]
    return dict(source="generate, prompt_lookup", speedup_unconstrained=round(plain, 3),
                speedup_constrained=round(cons, 3), kept=round(cons / plain, 3), schemas=len(schemas))


# ----------------------------------------------------------------------------- a 32k tokenizer
def tokenizer_32k(vocab_size: int = 32768):
    """A byte-level BPE trained here on stdlib sources to vocab_size tokens (EOS id 0), for mask costs
    at a realistic vocabulary (no network: nothing is downloaded)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few schemas, small sizes (checks that it runs)")
    ap.add_argument("--limit", type=int, default=None, help="first N cases of the suite (0 = all)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="generate / spec sections")
    ap.add_argument("--batch", type=int, default=None, help="schemas per generate call")
    ap.add_argument("--mask-schemas", type=int, default=None, help="instances walked by the mask section")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed by the overhead section")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (median)")
    ap.add_argument("--spec-batch", type=int, default=None, help="rows of the spec section")
    ap.add_argument("--vocab32k", action="store_true", help="mask section also at V = 32k (a BPE trained here)")
    ap.add_argument("--out", default=None, help="write the result JSON here too")
    ap.add_argument("--case-timeout", type=float, default=60.0,
                    help="compile + accept sections alone: seconds one system may spend on one case (compile + "
                         "accept, in its worker process) before it is killed and counted not compiled; 0 = no limit")
    ap.add_argument("--case-memory-gb", type=float, default=6.0,
                    help="compile + accept sections alone: resident memory (GB) of a system's worker past which the "
                         "case is killed and counted not compiled; 0 = no limit")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile + accept sections alone: (case, system) pairs run at once, each in its "
                         "system's worker (memory: up to jobs x --case-memory-gb)")
    args = ap.parse_args(argv)
    args.quick = bool(args.quick)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if args.case_timeout < 0 or args.case_memory_gb < 0 or args.jobs < 1:
        ap.error(f"--case-timeout ({args.case_timeout}) and --case-memory-gb ({args.case_memory_gb}) must be >= 0 "
                 f"(0 = no limit) and --jobs ({args.jobs}) >= 1")

    import jax

    import jaxdecode
    # a fresh automaton cache: compile times are real compiles; generate then reads what they wrote
    os.environ["JAXDECODE_CACHE"] = tempfile.mkdtemp(prefix="bench_structured_")
    model = jaxdecode.load()
    tok, v, eos = model.tokenizer, model.config.vocab_size, model.config.eos_token_ids[0]
    cases = load_suite(args.limit, QUICK_FILES if args.quick else None)
    log(f"{len(cases)} schemas from {SUITE}")
    result = dict(bench="structured", device=str(jax.devices()[0]), jax=jax.__version__, schemas=len(cases),
                  vocab_size=v, versions=_versions(), settings={k: getattr(args, k) for k in QUICK})
    if set(sections) <= {"compile", "accept"}:  # nothing later needs the handles: a case at a time, budgeted
        result["settings"].update(case_timeout=args.case_timeout, case_memory_gb=args.case_memory_gb, jobs=args.jobs)
        t0 = time.perf_counter()

        def checkpoint(comp, acc, done):  # partial results on disk while a long run goes on
            if args.out:
                partial = dict(result, compile=comp, partial=dict(cases_done=done, seconds=round(time.perf_counter() - t0, 1)))
                if "accept" in sections:
                    partial["accept"] = acc
                with open(args.out, "w") as f:
                    json.dump(partial, f, indent=1, default=float)
        result["compile"], accept = section_compile_accept_budget(cases, [c.name for c in SYSTEM_CLASSES],
                                                                  model.path, v, eos, args, checkpoint)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if "accept" in sections:
            result["accept"] = accept
        log("  compile: " + ", ".join(f"{k} {r['compiled']}/{r['of']}" for k, r in result["compile"].items()))
        write_result(result, args.out)
        return 0
    systems = make_systems(tok, v, eos)
    handles, result["compile"] = section_compile(cases, systems)
    log("  compile: " + ", ".join(f"{k} {r['compiled']}/{r['of']}" for k, r in result["compile"].items()))
    if "accept" in sections:
        result["accept"] = section_accept(cases, systems, handles, tok)
        log("  accept: invalid accepted " + ", ".join(f"{k} {r['invalid_accepted']}/{r['invalid']}"
                                                       for k, r in result["accept"].items()))
    if "generate" in sections:
        result["generate"] = section_generate(cases, handles, model, args)
        log(f"  generate: {result['generate']}")
    if "mask" in sections:
        result["mask"] = {f"V{v}": section_mask(cases, systems, handles, tok, args, f"V={v}")}
        if args.vocab32k:
            log("  training a 32k BPE tokenizer on the stdlib ...")
            big = tokenizer_32k()
            vb = len(big)
            sys32 = make_systems(big, vb, big.eos_token_id)
            # the workload schemas only: compiling the whole suite again at 32k costs minutes per system
            result["mask"][f"V{vb}"] = section_mask([], sys32, {s: {} for s in sys32}, big, args, f"V={vb}")
    if "overhead" in sections:
        result["overhead"] = section_overhead(model, args)
    if "spec" in sections:
        result["spec"] = section_spec(cases, handles, model, args)
        log(f"  spec: {result['spec']}")
    write_result(result, args.out)
    return 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("outlines-core", "xgrammar", "llguidance", "jsonschema"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
