"""Constrained decoding over item sets (generative retrieval, STATIC; ALGORITHMS.md §6).

    index = build_index(items_or_file, vocab_size)          # sorted, de-duplicated CSR trie (host)
    index.save("items.npz"); index = load_index("items.npz")
    c = index.constraint(set_ids=[0, 2])                    # device-side Constraint, per-row item sets
    out = beam_search(config, params, prompts, lengths, num_beams=K, max_new_tokens=N, constraint=c)
    out = decode(config, params, prompts, lengths, max_new_tokens=N, method="greedy", constraint=c)
    dyn = DynamicIndex(index); dyn.add(...); dyn.remove(...); dyn.constraint(); dyn.compact()

Modules: index (building, layout, save/load), trie (the Constraint protocol on the device),
dynamic (additions / removals without a rebuild), search (constrained decoders and the model-free
beam search). The kernel of the step is jaxdecode.kernels.constrained.
"""
from jaxdecode.constraints.dynamic import DynamicIndex
from jaxdecode.constraints.index import ItemSetError, TrieIndex, build_index, load_index, read_items_file
from jaxdecode.constraints.search import (ConstrainedBeamOutput, constrained_beam_search, constrained_decode,
                                          trie_beam_search)
from jaxdecode.constraints.trie import Candidates, ConstraintError, TrieConstraint, TrieState

__all__ = ["Candidates", "ConstrainedBeamOutput", "ConstraintError", "DynamicIndex", "ItemSetError",
           "TrieConstraint", "TrieIndex", "TrieState", "build_index", "constrained_beam_search",
           "constrained_decode", "load_index", "read_items_file", "trie_beam_search"]
