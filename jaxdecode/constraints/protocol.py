"""The Constraint protocol every decoder takes (DESIGN.md), and helpers generic over its states.

A constraint is a pytree with
    prepare(vocab_size, eos_ids, max_new_tokens, batch) -> constraint   host checks, binds the EOS ids
    init(batch, beams=1) -> state                      per-row state pytree (leaves with leading axis R)
    allowed(state, width) -> bool[R, width]            tokens each row may emit next
    advance(state, tokens[R]) -> state                 follow the chosen tokens
    complete(state) -> bool[R]                         the row is finished without emitting more
    candidates(state, logits, num_beams, scores=None, *, min_depth, max_depth) -> Candidates
    step_to(state, next_nodes) -> state                beams picked their candidates
States carry `node`, a tuple of int32[R] arrays (what `Candidates.next` holds per candidate and
`step_to` takes back), and `replace(node=...)`; other leaves without a row axis (a trie's shared depth)
are the constraint's own. Implementations: TrieConstraint (item sets), AutomatonConstraint (regex /
JSON schema), IntersectConstraint (`intersect(c1, c2)`: both at once).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = float("-inf")


def select_rows(keep_new, new_state, old_state):
    """The state with rows where keep_new (bool[R]) from new_state, the others from old_state; leaves
    without a leading row axis (a trie's shared depth) come from new_state."""
    rows = keep_new.shape[0]

    def pick(n, o):
        if getattr(n, "ndim", 0) >= 1 and n.shape[0] == rows:
            return jnp.where(keep_new.reshape((rows,) + (1,) * (n.ndim - 1)), n, o)
        return n

    return jax.tree.map(pick, new_state, old_state)


def advance_each(constraint, state, tokens):
    """The states after each of K candidate tokens per row (tokens int32[R, K]): the state with every row
    repeated K times (row r * K + j took tokens[r, j]); leaves without a row axis pass as they are."""
    r, k = tokens.shape
    rep = jax.tree.map(lambda x: jnp.repeat(x, k, axis=0) if getattr(x, "ndim", 0) >= 1 and x.shape[0] == r
                       else x, state)
    return constraint.advance(rep, tokens.reshape(-1))


def topk_ending_and_not(logits, mask, ends, num_beams: int, impl: str = "auto"):
    """(values, tokens) [R, 2k], k = min(num_beams, V): each row's best k allowed tokens that do not end
    it, then its best k that do (ends bool[R, V]: the token finishes the row): enough candidates for an
    exact beam step when any token may end a row. Missing candidates are -1 (constrained_topk)."""
    from jaxdecode.kernels.constrained import constrained_topk
    k = min(num_beams, logits.shape[-1])
    va, ta = constrained_topk(logits, k, mask=mask & ~ends, impl=impl)
    vb, tb = constrained_topk(logits, k, mask=mask & ends, impl=impl)
    return jnp.concatenate([va, vb], axis=1), jnp.concatenate([ta, tb], axis=1)


# ----------------------------------------------------------------------------- intersection
@dataclasses.dataclass(frozen=True)
class IntersectState:
    parts: tuple  # (state of c1, state of c2)

    @property
    def node(self) -> tuple:
        return tuple(n for p in self.parts for n in p.node)

    def replace(self, **kw) -> "IntersectState":
        if "node" in kw:
            nodes, parts, i = tuple(kw.pop("node")), [], 0
            for p in self.parts:
                parts.append(p.replace(node=nodes[i:i + len(p.node)]))
                i += len(p.node)
            kw["parts"] = tuple(parts)
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(IntersectState, data_fields=["parts"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class IntersectConstraint:
    """Texts both constraints allow: the mask is the and of theirs, each advances on every token, and a
    row is complete when both are (with EOS ids: EOS is allowed where both allow it). A pytree."""
    parts: tuple  # (c1, c2)
    impl: str = "auto"  # constrained_topk implementation for candidates

    @property
    def eos_ids(self) -> tuple:
        return self.parts[0].eos_ids

    @property
    def vocab_size(self) -> int:
        return max(int(c.vocab_size) for c in self.parts)

    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None) -> "IntersectConstraint":
        return dataclasses.replace(self, parts=tuple(c.prepare(vocab_size, eos_ids, max_new_tokens, batch)
                                                     for c in self.parts))

    def init(self, batch: int, beams: int = 1) -> IntersectState:
        return IntersectState(parts=tuple(c.init(batch, beams) for c in self.parts))

    def allowed(self, state: IntersectState, width: int | None = None):
        width = max([self.vocab_size] + [e + 1 for e in self.eos_ids]) if width is None else int(width)
        a, b = (c.allowed(s, width) for c, s in zip(self.parts, state.parts))
        return a & b

    def advance(self, state: IntersectState, tokens) -> IntersectState:
        return IntersectState(parts=tuple(c.advance(s, tokens) for c, s in zip(self.parts, state.parts)))

    def complete(self, state: IntersectState):
        a, b = (c.complete(s) for c, s in zip(self.parts, state.parts))
        return a & b

    def candidates(self, state: IntersectState, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None):
        """Each row's best allowed tokens (mask form of the constrained top-k kernel on the joint mask),
        per row (parent None), enough for an exact beam step: with EOS ids the best num_beams + E;
        without, the best num_beams that end (both parts complete after the token) and the best
        num_beams that do not, which needs every token's successor (R x V advances: pass eos_ids for
        the fast path). Each winner's next states come from advancing both parts along it."""
        from jaxdecode.constraints.trie import Candidates
        from jaxdecode.kernels.constrained import constrained_topk

        r, v = logits.shape
        mask = self.allowed(state, v)
        eos = self.eos_ids
        if eos:
            values, tokens = constrained_topk(logits, min(num_beams + len(eos), v), mask=mask, impl=self.impl)
        else:
            every = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (r, v))
            ends_all = self.complete(advance_each(self, state, every)).reshape(r, v)
            values, tokens = topk_ending_and_not(logits, mask, ends_all, num_beams, self.impl)
        ok = tokens >= 0
        k = tokens.shape[1]
        moved = advance_each(self, state, jnp.maximum(tokens, 0))
        if eos:
            ends = jnp.any(tokens[..., None] == jnp.asarray(eos, tokens.dtype), axis=-1)
        else:
            ends = self.complete(moved).reshape(r, k)
        nxt = tuple(jnp.where(ok, n.reshape(r, k), -1) for n in moved.node)
        return Candidates(logprobs=jnp.where(ok, values, _NEG), tokens=jnp.where(ok, tokens, -1), ends=ends & ok,
                          next=nxt)

    def step_to(self, state: IntersectState, next_nodes) -> IntersectState:
        next_nodes, parts, i = tuple(next_nodes), [], 0
        for c, s in zip(self.parts, state.parts):
            n = len(s.node)
            parts.append(c.step_to(s, next_nodes[i:i + n]))
            i += n
        return IntersectState(parts=tuple(parts))


jax.tree_util.register_dataclass(IntersectConstraint, data_fields=["parts"], meta_fields=["impl"])


def intersect(c1, c2, *, impl: str = "auto"):
    """A constraint allowing exactly what both c1 and c2 allow (e.g. an item-set trie and a regex, or two
    automata). Two AutomatonConstraints give their product automaton (an AutomatonConstraint, exact:
    no dead ends); anything else the generic IntersectConstraint, whose rows can reach a prefix that
    each part allows but that has no common completion (then nothing is allowed: a decoder emits a
    forbidden token or a beam is lost). For an item set and a regex / schema use the exact
    `automaton.filter_index(index, automaton)` instead. EOS ids are bound to both parts by prepare."""
    for i, c in enumerate((c1, c2)):
        missing = [m for m in ("prepare", "init", "allowed", "advance", "complete", "candidates", "step_to")
                   if not hasattr(c, m)]
        if missing:
            from jaxdecode.constraints.trie import ConstraintError
            raise ConstraintError(f"intersect: argument {i + 1} ({type(c).__name__}) is not a constraint (it "
                                  f"lacks {', '.join(missing)})")
    from jaxdecode.constraints.automaton import AutomatonConstraint, intersect_constraints

    if all(isinstance(c, AutomatonConstraint) and c.host is not None for c in (c1, c2)):
        # Two automata: their product on the host, whose dead ends (a prefix each allows, but no common
        # completion) are pruned; the generic form below cannot see those.
        return intersect_constraints(c1, c2)
    return IntersectConstraint(parts=(c1, c2), impl=impl)
