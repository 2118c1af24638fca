"""Drafters for speculative decoding, and `make_drafter` to build one by name.

Names: "draft_lm" (any jaxdecode model as a draft LM, with any tree builder), "prompt_lookup",
"aggressive", "token_recycling", "aded". Tree specs: see `builders.parse_tree_spec`.
"""
from __future__ import annotations

from jaxdecode.drafters.builders import (ChainBuilder, DynamicTreeBuilder, StaticTreeBuilder,
                                         parse_tree_spec)
from jaxdecode.drafters.draft_lm import DraftLM

DRAFTERS = ("draft_lm", "prompt_lookup", "aggressive", "token_recycling", "aded")


def _tree_or_default(tree, default, temperature: float):
    """A builder from a spec; chains sample their children when decoding samples."""
    spec = default if tree is None else tree
    if isinstance(spec, str) and spec.startswith("chain") and spec.count(":") == 1 and temperature > 0:
        spec = spec + ":sample"
    return parse_tree_spec(spec)


def make_drafter(name: str | None, target, draft=None, tree=None, temperature: float = 0.0, **kw):
    """Build a drafter for `target` (a jaxdecode.Model). `draft` is a Model for "draft_lm"."""
    name = name or ("draft_lm" if draft is not None else "prompt_lookup")
    if name in ("draft_lm", "draft", "model"):
        if draft is None:
            raise ValueError("drafter 'draft_lm' needs a draft model: pass draft=jaxdecode.load(DIR) "
                             "(CLI: --draft DIR)")
        return DraftLM(params=draft.params, config=draft.config,
                       builder=_tree_or_default(tree, "chain:4", temperature))
    if name == "token_recycling":
        from jaxdecode.drafters.recycling import TokenRecyclingDrafter
        from jaxdecode.drafters.recycling import recycling_template
        if tree is not None:  # 'static:...' is the template M is expanded along; 'nodes:N' its size
            kw.setdefault("template", parse_tree_spec(tree).paths if str(tree).startswith("static")
                          else recycling_template(_node_budget(tree, default=48)))
        return TokenRecyclingDrafter(vocab_size=target.config.vocab_size, **kw)
    if name == "aded":
        from jaxdecode.drafters.aded import ADEDDrafter
        if tree is not None:
            kw.setdefault("num_nodes", _node_budget(tree, default=16))
        return ADEDDrafter(vocab_size=target.config.vocab_size, **kw)
    n = _node_budget(tree, default=8)
    if name == "prompt_lookup":
        from jaxdecode.drafters.ngram import PromptLookupDrafter
        return PromptLookupDrafter(num_nodes=n, **kw)
    if name == "aggressive":
        from jaxdecode.drafters.ngram import AggressiveDrafter
        return AggressiveDrafter(num_nodes=n, **kw)
    raise ValueError(f"unknown drafter {name!r}; choose one of {DRAFTERS}")


def _node_budget(tree, default: int) -> int:
    """Node budget for retrieval drafters: 'chain:N', 'nodes:N' or an int."""
    if tree is None:
        return default
    if isinstance(tree, int):
        return tree
    if isinstance(tree, str) and tree.split(":")[0] in ("chain", "nodes"):
        return int(tree.split(":")[1])
    raise ValueError(f"drafters that retrieve a continuation propose chains: use tree='chain:N', got "
                     f"{tree!r}")


__all__ = ["ChainBuilder", "DynamicTreeBuilder", "StaticTreeBuilder", "DraftLM", "make_drafter",
           "parse_tree_spec", "DRAFTERS"]
