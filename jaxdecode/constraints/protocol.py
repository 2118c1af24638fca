"""The Constraint protocol every decoder takes (DESIGN.md), and helpers generic over its states.

A constraint is a pytree with
    prepare(vocab_size, eos_ids, max_new_tokens, batch) -> constraint   host checks, binds the EOS ids
    init(batch, beams=1) -> state                      per-row state pytree (leaves with leading axis R)
    allowed(state, width) -> bool[R, width]            tokens each row may emit next
    advance(state, tokens[R]) -> state                 follow the chosen tokens
    complete(state) -> bool[R]                         the row is finished without emitting more
    candidates(state, logits, num_beams, scores=None, *, min_depth, max_depth) -> Candidates
    step_to(state, next_nodes) -> state                beams picked their candidates
Implementations: TrieConstraint (item sets), AutomatonConstraint (regex / JSON schema).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def select_rows(keep_new, new_state, old_state):
    """The state with rows where keep_new (bool[R]) from new_state, the others from old_state; leaves
    without a leading row axis (a trie's shared depth) come from new_state."""
    rows = keep_new.shape[0]

    def pick(n, o):
        if getattr(n, "ndim", 0) >= 1 and n.shape[0] == rows:
            return jnp.where(keep_new.reshape((rows,) + (1,) * (n.ndim - 1)), n, o)
        return n

    return jax.tree.map(pick, new_state, old_state)
