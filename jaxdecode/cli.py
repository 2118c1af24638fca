r"""Command line: `jaxdecode generate | methods | demo | train | index`.

    jaxdecode generate --model DIR --prompt TEXT [--prompt TEXT ...] | --prompts-file FILE
                       --method NAME --max-new-tokens N [--temperature T] [--seed S] [--json]
    jaxdecode generate --method constrained_beam --index items.npz [--set-id S ...] ...
    jaxdecode generate --regex PATTERN | --json-schema FILE | --grammar FILE ...   (structured output;
                       each repeatable: one per prompt; --json adds "valid", "validator", "backend")
    jaxdecode index build ITEMS_FILE --vocab-size V --out items.npz   (one item per line, ids by spaces)
    jaxdecode index info items.npz
    jaxdecode bench --model DIR --prompts-file F --method greedy --method 'speculative:tree=chain:4'
                    [--batch-size 1,4] [--max-new-tokens N] [--json]   (jaxdecode.bench: the row fields)
    jaxdecode calibrate --model DIR [--draft DIR] [--drafter NAME] [--tree SPEC] --batch-size 1,4,16
                        [--temperature 0,0.7]   (step costs for adaptive speculation, cached; jaxdecode.costmodel)
    (the constrained-decoding benchmark is `python benchmarks/bench_constrained.py` in a checkout;
     `jaxdecode index bench` only says so)

    jaxdecode generate --chat --prompt TEXT [--system TEXT]   (the tokenizer's chat template)
    jaxdecode generate --prompts-file prompts.jsonl   ({"prompt": ...} | {"messages": [...]} | {"ids": [...]})
    jaxdecode generate --stop '\n\n' --logprobs --top-logprobs 5 --echo --stream ...

With --json, one JSON object per output per line: {"prompt", "text", "tokens", "finish_reason", "stats"} (+
"logprobs", "top_logprobs", "prompt_logprobs", "stop", structured-output fields when asked), then one last
line {"batch_stats": {...}}: the call's whole-batch figures (seconds, compile_seconds, target_calls, ...).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path


def _add_generate(sub):
    from jaxdecode.options import OPTIONS, cli_help
    g = sub.add_parser("generate", help="generate continuations of prompts",
                       description="Every method option has a flag or --option KEY=VALUE; what each accepts "
                                   "and its default are in jaxdecode.options.OPTIONS (README, 'Options').")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory, or an embedded model's name: target, draft, dllm "
                        "(default: the embedded target; the embedded dLLM for --method diffusion)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    src.add_argument("--prompt-ids", action="append", default=None, metavar="ID,ID,...",
                     help="a prompt as token ids, comma-separated (repeatable); used as given (no BOS added)")
    src.add_argument("--prompts-file", default=None,
                     help="prompts: a .jsonl file, one JSON object per line: {\"prompt\": TEXT} or {\"messages\": "
                          "[{\"role\": ..., \"content\": ...}, ...]} or {\"ids\": [...]}; any other file: one "
                          "prompt per line (--prompts-format overrides the choice by extension)")
    g.add_argument("--prompts-format", choices=["jsonl", "lines"], default=None,
                   help="how to read --prompts-file (default: jsonl for .jsonl / .ndjson files, else lines)")
    g.add_argument("--chat", action="store_true",
                   help="each --prompt is a user message, formatted by the tokenizer's chat template (with "
                        "--system as the system message)")
    g.add_argument("--system", default=None, help="with --chat: a system message before each user message")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="the chat template's own variables, as a JSON object, for --chat and \"messages\" "
                        "prompts, e.g. '{\"enable_thinking\": false}' (Qwen3)")
    g.add_argument("--method", default=None,
                   help="decoding method (see `jaxdecode methods`; default: the checkpoint's "
                        "generation_config.json: sample if do_sample, beam if num_beams > 1, else greedy)")
    g.add_argument("--num-return-sequences", type=int, default=None,
                   help="outputs per prompt (sampling: independent draws; beam: the best beams)")
    g.add_argument("--no-add-special-tokens", dest="add_special_tokens", action="store_const", const=False,
                   default=None, help="encode text prompts without the tokenizer's special tokens (no BOS)")
    g.add_argument("--keep-special-tokens", action="store_true",
                   help="keep special tokens (EOS, chat markers) in the printed text")
    g.add_argument("--echo", action="store_true", help="also report the prompt tokens' log-probs")
    g.add_argument("--stream", action="store_true",
                   help="print the text as it is produced (one prompt; the stats follow at the end)")
    _add_dtype_args(g)
    # One flag per option of the table; unset flags stay None, i.e. the method's default.
    for name, opt in OPTIONS.items():
        if opt.cli is None:
            continue
        kw = dict(dest=name, default=None, help=cli_help(opt).replace("%", "%%"))
        if opt.kind == "bool":  # a switch on by default has the flag --no-NAME (Option.cli)
            kw["action"] = "store_const"
            kw["const"] = opt.default is not True
        else:
            kw["type"] = {"int": int, "float": float, "ids": _id_list, "int_or_ids": int,
                          "stopping": _stopping}.get(opt.kind, str)
            if opt.objects and opt.kind == "str" and opt.low is not None:
                kw["type"] = _str_or_int  # tree: a spec or a node count
            if opt.cli_repeat:  # a list of ids: each flag adds one or more ("--eos-id 2 --eos-id 7,9"; "[]": none)
                kw["action"] = "extend" if opt.kind == "ids" else "append"
        g.add_argument(opt.cli, **kw)
    rest = [n for n, o in OPTIONS.items() if o.cli is None and n != "mesh"]
    g.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help=f"any method option, value parsed as JSON when possible (e.g. "
                        f"'verify_widths=[2,4]'); the options without a flag: {', '.join(rest)}")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt per line")


def _add_dtype_args(parser):
    from jaxdecode.model import DTYPES
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="compute dtype of the model(s) (default: float32 on CPU, the checkpoint's own on GPU/TPU)")
    parser.add_argument("--param-dtype", default=None, choices=DTYPES,
                        help="store the weight matrices in this dtype while computing in --dtype (e.g. bfloat16: "
                             "weight-only half precision; README, Numerics and dtypes)")


def _dtype_kw(args) -> dict:
    return {"dtype": args.dtype, "param_dtype": args.param_dtype}


def _str_or_int(text: str):
    return int(text) if text.isdigit() else text


def _stopping(text: str):
    """--early-stopping true | false | never."""
    value = {"true": True, "false": False, "never": "never"}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true, false or never, got {text!r}")
    return value


def _id_list(text: str) -> list:
    """A flag's token ids: "7", "7,9" or a JSON list ("[7, 9]"; "[]" adds none, so `--eos-id '[]'` alone
    means no EOS)."""
    body = text.strip()
    body = body[1:-1] if body.startswith("[") and body.endswith("]") else body
    try:
        return [int(x) for x in body.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids such as 7, 7,9 or [] (none), got {text!r}") from None


def _parse_option(text: str):
    if "=" not in text:
        raise ValueError(f"--option expects KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k.replace("-", "_"), json.loads(v)
    except json.JSONDecodeError:
        return k.replace("-", "_"), v


def _default_model(method: str) -> str:
    """The embedded model a method runs on when no --model is given: the dLLM for method="diffusion"."""
    from jaxdecode.registry import get_method
    try:
        return "dllm" if get_method(method).name == "diffusion" else "target"
    except ValueError:  # an unknown method: generate names the available ones
        return "target"


def _read_prompts(args) -> list:
    """The prompts of `jaxdecode generate`: texts, token-id lists or conversations."""
    if args.prompts_file:
        return read_prompts_file(args.prompts_file, args.prompts_format)
    if args.prompt_ids:
        out = []
        for text in args.prompt_ids:
            try:
                out.append([int(t) for t in text.replace(" ", "").split(",") if t != ""])
            except ValueError:
                raise ValueError(f"--prompt-ids {text!r}: give token ids separated by commas, e.g. 1,15,27") from None
            if not out[-1]:
                raise ValueError("--prompt-ids: an empty list of ids")
        return out
    if args.prompt:
        if not args.chat:
            if args.system is not None:
                raise ValueError("--system is a chat message: use it with --chat")
            return list(args.prompt)
        system = [] if args.system is None else [{"role": "system", "content": args.system}]
        return [system + [{"role": "user", "content": p}] for p in args.prompt]
    raise ValueError("give at least one --prompt TEXT, --prompt-ids IDS or --prompts-file FILE")


def read_prompts_file(path, fmt: str | None = None) -> list:
    """A prompts file: JSONL ({"prompt": TEXT} | {"messages": [...]} | {"ids": [...]} per line) or one
    prompt per line."""
    fmt = fmt or ("jsonl" if str(path).endswith((".jsonl", ".ndjson")) else "lines")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise FileNotFoundError(f"--prompts-file {path}: cannot read it ({e.strerror})") from None
    if fmt == "lines":
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"{path} has no non-empty lines")
        return prompts
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e.msg}); a .jsonl prompts file has one object per "
                             f"line (--prompts-format lines reads it as plain text)") from None
        keys = [k for k in ("prompt", "messages", "ids") if isinstance(obj, dict) and k in obj]
        if len(keys) != 1:
            raise ValueError(f"{path}:{n}: each line needs exactly one of \"prompt\" (text), \"messages\" (a "
                             f"conversation) or \"ids\" (token ids), got {line[:80]!r}")
        value = obj[keys[0]]
        ok = {"prompt": lambda v: isinstance(v, str) and v != "",
              "messages": lambda v: isinstance(v, list) and bool(v) and all(isinstance(m, dict) for m in v),
              "ids": lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                      for t in v)}[keys[0]](value)
        if not ok:
            want = {"prompt": "a non-empty string", "messages": "a non-empty list of {\"role\", \"content\"} objects",
                    "ids": "a non-empty list of ints"}[keys[0]]
            raise ValueError(f"{path}:{n}: \"{keys[0]}\" must be {want}")
        prompts.append(value)
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def _unescape(text: str) -> str:
    """A stop string typed on a command line: backslash escapes (\\n, \\t, \\\\) read as characters."""
    import codecs
    return codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")


def cmd_generate(args) -> int:
    import jaxdecode
    from jaxdecode.options import OPTIONS
    prompts = _read_prompts(args)
    options = {k: getattr(args, k) for k, o in OPTIONS.items() if o.cli is not None and getattr(args, k) is not None}
    if isinstance(options.get("set_ids"), list) and len(options["set_ids"]) == 1:
        options["set_ids"] = options["set_ids"][0]  # one --set-id: every prompt
    if options.get("stop") is not None:
        options["stop"] = [_unescape(t) for t in options["stop"]]
    _read_structured(options)
    for text in args.option:
        key, value = _parse_option(text)
        if key in options:
            raise ValueError(f"option {key} is given twice (a flag and --option); give it once")
        options[key] = value
    model = jaxdecode.load(args.model or _default_model(args.method or "greedy"), **_dtype_kw(args))
    if args.chat_template_kwargs is not None:
        try:
            options["chat_template_kwargs"] = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template-kwargs {args.chat_template_kwargs!r} is not JSON ({e.msg}); give an "
                             f"object, e.g. '{{\"enable_thinking\": false}}'") from None
    call = dict(method=args.method, num_return_sequences=args.num_return_sequences,
                add_special_tokens=args.add_special_tokens, skip_special_tokens=not args.keep_special_tokens,
                echo=args.echo, **options)
    if args.stream:  # row 0 as it comes; other rows (prompts, num_return_sequences) when the decode ends
        from jaxdecode.streaming import stream_to
        out = io.StringIO() if args.json else sys.stdout
        several = len(prompts) > 1 or (args.num_return_sequences or 1) > 1

        def prefix(row: int, prompt) -> str:  # a header when there are several outputs, then a text prompt
            return (f"--- prompt: {prompt!r}\n" if several or row else "") + _shown_prompt(prompt)
        results = stream_to(out, model, prompts, prefix=prefix, **call)
    else:
        results = jaxdecode.generate(model, prompts, **call)
    for i, r in enumerate(results):
        if args.json:
            print(json.dumps(r.to_json()))
        elif not args.stream:
            print(f"--- prompt: {r.prompt!r}" + (f" (output {r.index + 1})" if r.index else ""))
            print(_shown_prompt(r.prompt) + r.text)
        elif len(results) > 1:  # the texts were streamed above: say whose figures follow
            print(f"--- output {i + 1} of {len(results)} (prompt {r.prompt!r:.60})")
        if not args.json:
            if r.constraint is not None:
                print(f"    valid: {r.valid} ({r.constraint} checked by {r.validator}; enforced by {r.backend})")
            print(f"    finish: {r.finish_reason}" + (f" (stop string {r.stop!r})" if r.stop is not None else ""))
            if r.logprobs is not None:
                print(f"    logprobs: {[round(x, 4) for x in r.logprobs]}")
            if r.top_logprobs is not None:
                print(f"    top_logprobs: {[[(i, round(v, 4)) for i, v in step] for step in r.top_logprobs]}")
            if r.prompt_logprobs is not None:
                print(f"    prompt_logprobs: {[None if x is None else round(x, 4) for x in r.prompt_logprobs]}")
            print(f"    stats: {r.stats}")
    batch = results[0].batch_stats if results else {}
    # Whole-call figures once (every row shares them): a last line {"batch_stats": ...} under --json.
    print(json.dumps({"batch_stats": batch}) if args.json else f"batch stats: {batch}")
    return 0


def _shown_prompt(prompt) -> str:
    """What the text output prints before a row's new text: a text prompt itself, nothing for ids / chats."""
    return prompt if isinstance(prompt, str) else ""


def _read_structured(options: dict) -> None:
    """--regex / --json-schema FILE|JSON / --grammar FILE|TEXT (each repeatable: one for all prompts, or one
    per prompt): read the schema files (parsed as JSON; generate reads grammar files), one flag = one value
    for every prompt."""
    for name in ("regex", "json_schema", "grammar"):
        values = options.get(name)
        if values is None:
            continue
        if not isinstance(values, list):
            values = [values]
        if name == "json_schema":  # grammar= takes a file's path itself (structured._grammar_text)
            values = [_read_file(name, v) for v in values]
        options[name] = values[0] if len(values) == 1 else values


def _read_file(name: str, path: str):
    """A --json-schema value: a file's content parsed as JSON, else the value itself when it is the
    schema's JSON text, as the option's help says."""
    flag = "--" + name.replace("_", "-")
    if not os.path.isfile(path):
        try:
            return json.loads(path)
        except json.JSONDecodeError:
            raise FileNotFoundError(f"{flag} {path[:80]!r}: neither a readable file nor JSON text") from None
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise FileNotFoundError(f"{flag} {path}: cannot read the file ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not a JSON file ({e})") from None


def cmd_methods(args) -> int:
    import jaxdecode
    for name, desc in jaxdecode.methods().items():
        print(f"{name:20s} {desc}")
    return 0


def cmd_demo(args) -> int:
    from jaxdecode.demo import run_demo
    return run_demo(max_new_tokens=args.max_new_tokens)


def _add_index(sub):
    ix = sub.add_parser("index", help="item indexes for constrained decoding (build, info, bench)")
    isub = ix.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser("build", help="build an index from a file with one item per line")
    b.add_argument("items", help="file: one item per line, token ids separated by spaces")
    b.add_argument("--vocab-size", type=int, required=True, help="token ids must be < this")
    b.add_argument("--out", required=True, help="output .npz")
    b.add_argument("--set-ids", default=None, help="optional file: the item set of each line (one int per line)")
    b.add_argument("--dense-levels", default=None,
                   help="comma-separated item depths with dense tables ('' for none; default: where they pay)")
    i = isub.add_parser("info", help="print an index's summary")
    i.add_argument("path")
    bench = isub.add_parser("bench", help="moved: python benchmarks/bench_constrained.py (in a checkout)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def cmd_index(args) -> int:
    import time

    import numpy as np

    from jaxdecode.constraints import build_index, load_index
    if args.index_command == "build":
        sets = None
        if args.set_ids:
            sets = np.loadtxt(args.set_ids, dtype=np.int64, ndmin=1)
        dense = None
        if args.dense_levels is not None:
            dense = [int(x) for x in args.dense_levels.split(",") if x.strip()]
        t0 = time.perf_counter()
        index = build_index(args.items, args.vocab_size, set_ids=sets, dense_levels=dense)
        path = index.save(args.out)
        print(json.dumps(dict(index.summary(), out=str(path), build_seconds=round(time.perf_counter() - t0, 3))))
        return 0
    if args.index_command == "info":
        print(json.dumps(load_index(args.path).summary()))
        return 0
    raise ValueError("`jaxdecode index bench` moved out of the library: run `python "
                     "benchmarks/bench_constrained.py` from a jaxdecode checkout (same options, --help)")


def _add_bench(sub):
    b = sub.add_parser("bench", help="measure methods on your model and prompts: tokens/s, speedup, tau",
                       description="Each --method is NAME or NAME:KEY=VALUE,KEY=VALUE (options of `jaxdecode "
                                   "generate`, values JSON when they parse, e.g. "
                                   "'speculative:drafter=prompt_lookup,tree=static:3,2,1'; a comma starts a new "
                                   "KEY= only before WORD=, and inside tree= only before an option name). "
                                   "Speedup is against the first --method "
                                   "at the same batch size; tokens/s excludes compilation (compile_seconds). "
                                   "Row fields: see jaxdecode.bench.")
    b.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded target)")
    b.add_argument("--draft", default=None, help="draft model directory, for the methods whose drafter uses one")
    b.add_argument("--drafter-dir", default=None,
                   help="trained drafter directory, for the methods naming the kind it holds (or naming no "
                        "drafter, without --draft)")
    b.add_argument("--prompts-file", required=True, help="a text file with one prompt per line, or a .jsonl file "
                   "as `jaxdecode generate --prompts-file` reads it")
    b.add_argument("--method", action="append", required=True, metavar="NAME[:KEY=VALUE,...]",
                   help="a method to measure (repeatable; the first is the baseline)")
    b.add_argument("--batch-size", default="1", help="batch sizes, comma-separated (default 1)")
    b.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt at most (default 32)")
    b.add_argument("--temperature", type=float, default=None, help="for the methods that take it, unless set in --method")
    b.add_argument("--seed", type=int, default=None, help="for the methods that take it, unless set in --method")
    b.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (default 1)")
    _add_dtype_args(b)
    b.add_argument("--json", action="store_true", help="one JSON object per (method, batch size) row")


def cmd_bench(args) -> int:
    import jaxdecode
    from jaxdecode.bench import (format_table, main_progress, parse_batch_sizes, prepare_methods, read_prompts,
                                 run_bench)
    prompts = read_prompts(args.prompts_file)  # bad requests fail before any model loads
    sizes = parse_batch_sizes(args.batch_size)
    prepare_methods(args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                    draft=args.draft, drafter_dir=args.drafter_dir)
    model = jaxdecode.load(args.model, **_dtype_kw(args))
    draft = jaxdecode.load(args.draft, **_dtype_kw(args)) if args.draft else None
    rows = run_bench(model, prompts, args.method, sizes, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, seed=args.seed, draft=draft, drafter_dir=args.drafter_dir,
                     repeats=args.repeats, progress=main_progress)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_table(rows))
    return 0


def _add_calibrate(sub):
    c = sub.add_parser("calibrate", help="measure (or show the cached) step costs of speculative decoding",
                       description="Times, on this device, the target's verification forward per tree width and "
                                   "the drafter's step, for each batch size, and caches the tables (the adaptive "
                                   "speculation of method='speculative' reads them; jaxdecode.costmodel). The "
                                   "drafter is built as `jaxdecode generate` builds it.")
    c.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded target)")
    c.add_argument("--draft", default=None, help="draft model directory (drafter draft_lm)")
    c.add_argument("--drafter", default=None, help="drafter name (default, as generate's: draft_lm with --draft; "
                                                   "the kind in --drafter-dir; else retrieval when the model "
                                                   "ships a datastore, as the embedded target does; else "
                                                   "prompt_lookup)")
    c.add_argument("--drafter-dir", default=None, help="trained drafter directory")
    c.add_argument("--tree", default=None, type=_str_or_int, help="tree spec, as `jaxdecode generate --tree`")
    c.add_argument("--batch-size", default="1", help="batch sizes, comma-separated (default 1), e.g. 1,4,16")
    c.add_argument("--temperature", default="0",
                   help="sampling temperatures the tables are for, comma-separated (default 0: greedy), e.g. 0,0.7; "
                        "a sampled step costs more than a greedy one, so each has its own table, and one table "
                        "serves every temperature above 0")
    c.add_argument("--context-len", type=int, default=None,
                   help="tokens in the KV cache while timing (default 256, within the model's positions); "
                        "rounded up to a power of two")
    c.add_argument("--widths", default=None,
                   help="verification widths to time, comma-separated (default: those generate's adaptive policy "
                        "verifies over, so it reads the table: 0, powers of two, the tree size and the drafter's "
                        "own widths; a table of other widths serves generate only through costs=)")
    _add_dtype_args(c)
    c.add_argument("--cache-dir", default=None, help="default $JAXDECODE_CACHE_DIR or ~/.cache/jaxdecode")
    c.add_argument("--refresh", action="store_true", help="measure again even when a table is cached")
    c.add_argument("--json", action="store_true", help="one JSON object per batch size")


def cmd_calibrate(args) -> int:
    import jaxdecode
    from jaxdecode.costmodel import calibrate, format_tables, parse_batch_sizes, parse_temperatures
    from jaxdecode.drafters import make_drafter
    from jaxdecode.files import default_cache_dir
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.treeopt import is_auto
    sizes = parse_batch_sizes(args.batch_size)  # bad requests fail before any model loads
    temperatures = parse_temperatures(args.temperature)
    if is_auto(args.tree):
        raise ValueError("--tree auto is chosen by `jaxdecode generate` on first use, which measures the tables "
                         "of the trees it tries (tree_auto_seconds) and caches its choice; calibrate the tree it "
                         "chose (batch_stats['tree'], e.g. --tree chain:5), or run that generate once")
    widths = None
    if args.widths is not None:
        try:
            widths = [int(w) for w in args.widths.split(",")]
        except ValueError:
            raise ValueError(f"--widths {args.widths!r}: give node counts separated by commas, e.g. 0,1,2,4") from None
    model = jaxdecode.load(args.model, **_dtype_kw(args))
    draft = jaxdecode.load(args.draft, **_dtype_kw(args)) if args.draft else None
    rows, temps = [], []
    for t in temperatures:  # the drafter as generate builds it for that temperature (a cut may read it)
        drafter = make_drafter(args.drafter, model, draft=draft, tree=args.tree, drafter_dir=args.drafter_dir,
                               temperature=t)
        sampler = SamplerConfig(temperature=t)
        # widths None: costmodel.policy_widths, the rule generate keys its tables by, so generate reads these
        rows += [calibrate(model, drafter, b, widths=widths, context_len=args.context_len, cache_dir=args.cache_dir,
                           refresh=args.refresh, sampler=sampler) for b in sizes]
        temps += [t] * len(sizes)
    if args.json:
        for (table, path, measured), t in zip(rows, temps):
            cached = None if path is None else str(path)  # None: the cache could not be written
            print(json.dumps(dict(table.to_json(), temperature=t, cache_file=cached, measured=measured)))
    else:  # one table per temperature (the header says greedy or sampled)
        print("\n\n".join(format_tables(rows[i:i + len(sizes)]) for i in range(0, len(rows), len(sizes))))
    if args.cache_dir is not None and Path(args.cache_dir).expanduser().resolve() != default_cache_dir().resolve():
        print(f"note: generate and bench read tables from {default_cache_dir()}; set JAXDECODE_CACHE_DIR="
              f"{args.cache_dir} for them to read these", file=sys.stderr)
    return 0


def build_parser(with_train: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdecode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    sub.add_parser("methods", help="list the decoding methods")
    d = sub.add_parser("demo", help="the main job: generate with the default model and report speed")
    d.add_argument("--max-new-tokens", type=int, default=64)
    _add_index(sub)
    _add_bench(sub)
    _add_calibrate(sub)
    if with_train:  # imported only when asked for: decoding never imports the training module
        from jaxdecode.training.cli import add_train_parser
        add_train_parser(sub)
    else:
        sub.add_parser("train", help="train models (jaxdecode train --help)", add_help=False)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(with_train=bool(argv) and argv[0] == "train").parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "methods":
            return cmd_methods(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "index":
            return cmd_index(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "train":
            from jaxdecode.training.cli import run_train
            return run_train(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxdecode: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
