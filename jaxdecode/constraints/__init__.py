r"""Constrained decoding over item sets (generative retrieval, STATIC; ALGORITHMS.md §6).

    index = build_index(items_or_file, vocab_size)          # sorted, de-duplicated CSR trie (host)
    index.save("items.npz"); index = load_index("items.npz")
    c = index.constraint(set_ids=[0, 2])                    # device-side Constraint, per-row item sets
    out = beam_search(config, params, prompts, lengths, num_beams=K, max_new_tokens=N, constraint=c)
    out = decode(config, params, prompts, lengths, max_new_tokens=N, method="greedy", constraint=c)
    dyn = DynamicIndex(index); dyn.add(...); dyn.remove(...); dyn.constraint(); dyn.compact()

Regex / JSON schema (ALGORITHMS.md §6): token automata compiled on the host, run on the device.

    auto = compile_regex(r"[0-9]{1,3}", tokenizer)           # or compile_json_schema(schema, tokenizer)
    out = decode(config, params, prompts, lengths, ..., constraint=auto.constraint())
    c = per_row_constraint([schema_a, r"\d+", schema_a], tokenizer)   # a pattern per batch row
    c = filter_index(index, auto).constraint()              # the items the pattern accepts (exact)
    c = intersect(c1, c2)                                    # both at once (any two constraints)

Modules: index (building, layout, save/load), trie (the Constraint protocol on the device),
dynamic (additions / removals without a rebuild), search (constrained decoders and the model-free
beam search), automaton (regex / JSON-schema token automata), protocol (the protocol, intersection).
The kernel of the step is jaxdecode.kernels.constrained.
"""
from jaxdecode.constraints.automaton import (AutomatonConstraint, AutomatonError, TokenAutomaton, check_schema,
                                             compile_json_schema, compile_regex, filter_index, per_row_constraint,
                                             stack_automata)
from jaxdecode.constraints.dynamic import DynamicIndex
from jaxdecode.constraints.index import ItemSetError, TrieIndex, build_index, load_index, read_items_file
from jaxdecode.constraints.search import (ConstrainedBeamOutput, constrained_beam_search, constrained_decode,
                                          trie_beam_search)
from jaxdecode.constraints.protocol import IntersectConstraint, intersect
from jaxdecode.constraints.trie import Candidates, ConstraintError, TrieConstraint, TrieState

__all__ = ["AutomatonConstraint", "AutomatonError", "Candidates", "ConstrainedBeamOutput", "ConstraintError",
           "DynamicIndex", "IntersectConstraint", "ItemSetError", "TokenAutomaton", "TrieConstraint", "TrieIndex",
           "TrieState", "build_index", "check_schema", "compile_json_schema", "compile_regex",
           "constrained_beam_search", "constrained_decode", "filter_index", "intersect", "load_index", "per_row_constraint",
           "read_items_file", "stack_automata", "trie_beam_search"]
