"""Command line: `jaxdecode generate | methods | demo | train`.

    jaxdecode generate --model DIR --prompt TEXT [--prompt TEXT ...] | --prompts-file FILE
                       --method NAME --max-new-tokens N [--temperature T] [--seed S] [--json]

With --json, one JSON object per prompt per line: {"prompt", "text", "tokens", "stats"}.
"""
from __future__ import annotations

import argparse
import json
import sys


def _add_generate(sub):
    g = sub.add_parser("generate", help="generate continuations of prompts")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the embedded target model)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    src.add_argument("--prompts-file", default=None, help="a file with one prompt per line")
    g.add_argument("--method", default="greedy", help="decoding method (see `jaxdecode methods`)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--num-beams", type=int, default=None)
    g.add_argument("--length-penalty", type=float, default=None)
    g.add_argument("--num-groups", type=int, default=None)
    g.add_argument("--diversity-penalty", type=float, default=None)
    g.add_argument("--tau", type=float, default=None, help="Mirostat target surprise (bits)")
    g.add_argument("--eta", type=float, default=None, help="Mirostat learning rate")
    g.add_argument("--draft", default=None, help="draft model directory (speculative, drafter draft_lm)")
    g.add_argument("--drafter", default=None,
                   help="speculative drafter: draft_lm, prompt_lookup, aggressive, token_recycling, aded")
    g.add_argument("--tree", default=None,
                   help="tree spec: chain:4, static:3,2,1, eagle:depth=5,topk=8,total=48, dyspec:num_nodes=32")
    g.add_argument("--verifier", default=None,
                   help="greedy, chain, point_mass, block, specinfer, rsd, topk, spectr, gbv, typical (lossy)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    g.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other method option (value parsed as JSON when possible)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt per line")


# CLI flags that map 1:1 to generate() options when given.
_FLAG_OPTIONS = ("top_k", "top_p", "min_p", "repetition_penalty", "num_beams", "length_penalty",
                 "num_groups", "diversity_penalty", "tau", "eta", "draft", "drafter", "tree", "verifier")


def _parse_option(text: str):
    if "=" not in text:
        raise SystemExit(f"--option expects KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k.replace("-", "_"), json.loads(v)
    except json.JSONDecodeError:
        return k.replace("-", "_"), v


def cmd_generate(args) -> int:
    import jaxdecode
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise SystemExit(f"{args.prompts_file} has no non-empty lines")
    elif args.prompt:
        prompts = args.prompt
    else:
        raise SystemExit("give at least one --prompt TEXT or --prompts-file FILE")
    model = jaxdecode.load(args.model, dtype=args.dtype)
    options = {k: getattr(args, k) for k in _FLAG_OPTIONS if getattr(args, k) is not None}
    options.update(_parse_option(o) for o in args.option)
    results = jaxdecode.generate(model, prompts, method=args.method,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 seed=args.seed, **options)
    for r in results:
        if args.json:
            print(json.dumps(r.to_json()))
        else:
            print(f"--- prompt: {r.prompt!r}")
            print(r.prompt + r.text if isinstance(r.prompt, str) else r.text)
            print(f"    stats: {r.stats}")
    return 0


def cmd_methods(args) -> int:
    import jaxdecode
    for name, desc in jaxdecode.methods().items():
        print(f"{name:20s} {desc}")
    return 0


def cmd_demo(args) -> int:
    from jaxdecode.demo import run_demo
    return run_demo(max_new_tokens=args.max_new_tokens)


def build_parser(with_train: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdecode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    sub.add_parser("methods", help="list the decoding methods")
    d = sub.add_parser("demo", help="the main job: generate with the default model and report speed")
    d.add_argument("--max-new-tokens", type=int, default=64)
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
        if args.command == "train":
            from jaxdecode.training.cli import run_train
            return run_train(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxdecode: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
