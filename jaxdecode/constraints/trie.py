"""The trie constraint on the device: the Constraint protocol of DESIGN.md over one or more CSR tries.

    c = index.constraint(set_ids=None)           # a TrieConstraint (a pytree: pass it into jit)
    c = c.prepare(vocab_size, eos_ids, max_new_tokens, batch)    # host checks, binds the EOS ids
    state = c.init(batch)                        # TrieState: each row at its item set's root
    mask = c.allowed(state)                      # bool[R, V]     (greedy / sampling: mask the logits)
    state = c.advance(state, tokens)             # follow the chosen tokens
    cands = c.candidates(state, logits, k)       # the STATIC beam step: each row's k best allowed
                                                 # tokens with log-probs, end flags and next states
    state = c.step_to(state, next_nodes)         # beams picked their candidates

State. `TrieState.node` holds one int32[R] array of trie states per part (-1 = not in that part);
`depth` is the number of item tokens emitted so far, the same for every row because every row advances
one level per step. A node of -1 in every part is a finished (or dead) row. The level loop needs static
row widths, so every depth-dependent op is a `lax.switch` over the item depths, each branch with its
level's own width K_d (the STATIC per-level `max_branch_factors`).

Ends. With EOS ids bound (`prepare(..., eos_ids)`), an item ends by emitting an EOS id, which is
allowed exactly at final states (so an item may be a prefix of another). Without EOS ids, an item ends
when its row reaches a final state, which must then be a leaf: indexes with prefix items need EOS ids
(`prepare` says so). Either way every hypothesis a decoder finishes is an item of the row's set.

Parts. A plain index is one part. `DynamicIndex` (added / removed items without a rebuild) is two: the
base trie with `alive_bits` (a state whose every item was removed is skipped) and an updated copy of
its final bits and dense tables, and a small delta trie of added items. A step takes the union: every
part's CSR row, a delta token already offered by the base dropped, and the other part's next state
found by binary search. Per-request item sets live in one index as different set roots
(`index.build_index(..., set_ids=...)`); `set_ids` here says which set each batch row decodes from.

Candidate selection per level (exact for beam search): the beam step needs, from every row, the best
`num_beams` non-ending candidates and the best `num_beams` ending ones. With EOS ids, at most E slots
end, so the row's top num_beams + E suffices; without them, a level whose children are all leaves or
all inner nodes needs the top num_beams, and a level that mixes both (variable-length items) takes the
top num_beams of each kind. Dense levels (index.dense) use the mask form of the kernel, the others the
CSR candidate form (`jaxdecode.kernels.constrained.constrained_topk`); on the pure-jnp reference path
(CPU) only levels whose rows span at least half the vocabulary use the mask.
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.kernels.common import concrete, next_pow2, shard_map
from jaxdecode.kernels.constrained import constrained_topk, resolve_impl, row_axis

_NEG = float("-inf")


class ConstraintError(ValueError):
    """A constraint that cannot be used with the given model, EOS ids, lengths or batch."""


# ----------------------------------------------------------------------------- pytrees
@dataclasses.dataclass(frozen=True)
class TriePart:
    """One CSR trie on the device (see jaxdecode.constraints.index for the layout)."""
    edge_token: jax.Array  # int16|int32[E]: token of edge e, which leads to state e + 1
    indptr: jax.Array  # int32[n_inner + 1]
    final_bits: jax.Array  # uint8[ceil(S / 8)]
    alive_bits: jax.Array | None  # uint8[ceil(S / 8)] or None: every state has a live item below it
    dense: tuple  # bool[n_states of the level, V] per level in dense_levels
    level_start: jax.Array  # int32[levels + 1]: first state of each internal level, then S
    level_width: tuple  # static: widest row per internal level (a bound: wider is still exact)
    level_kind: tuple  # static, per internal level: bit 1 = has leaf states, bit 2 = has inner states
    dense_levels: tuple  # static: internal levels with a dense table

    @property
    def n_inner(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_levels(self) -> int:
        return len(self.level_width)

    def width(self, lv: int) -> int:
        return int(self.level_width[lv]) if lv < self.num_levels else 0

    def kind(self, lv: int) -> int:
        return int(self.level_kind[lv]) if lv < self.num_levels else 0

    @property
    def max_width(self) -> int:
        return max(self.level_width[1:] + (1,))


jax.tree_util.register_dataclass(
    TriePart, data_fields=["edge_token", "indptr", "final_bits", "alive_bits", "dense", "level_start"],
    meta_fields=["level_width", "level_kind", "dense_levels"])


@dataclasses.dataclass(frozen=True)
class TrieState:
    node: tuple  # int32[R] per part; -1 = no state in that part
    depth: jax.Array  # int32 scalar: item tokens emitted so far

    def replace(self, **kw) -> "TrieState":
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(TrieState, data_fields=["node", "depth"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Candidates:
    """Each row's best allowed next tokens (the STATIC step's output), best first."""
    logprobs: jax.Array  # f32[R, C]; -inf = no candidate
    tokens: jax.Array  # int32[R, C]; -1 = no candidate
    ends: jax.Array  # bool[R, C]: taking it finishes the item (EOS, or a leaf without EOS ids)
    next: tuple  # int32[R, C] per part: the state after the token


jax.tree_util.register_dataclass(Candidates, data_fields=["logprobs", "tokens", "ends", "next"],
                                 meta_fields=[])


# ----------------------------------------------------------------------------- trie primitives
def _bit(bits, idx):
    """bool[...]: bit idx (>= 0) of a little-endian packed uint8 array."""
    i = jnp.clip(idx, 0, bits.shape[0] * 8 - 1)
    return ((bits[i >> 3] >> (i & 7).astype(jnp.uint8)) & 1).astype(bool)


def _final(part: TriePart, node):
    return (node >= 0) & _bit(part.final_bits, node)


def _alive(part: TriePart, node):
    ok = node >= 0
    return ok if part.alive_bits is None else ok & _bit(part.alive_bits, node)


def _row(part: TriePart, node):
    """(start, end) edge range of each node's children; empty for -1 and childless deepest states."""
    inner = (node >= 0) & (node < part.n_inner)
    n = jnp.clip(node, 0, part.n_inner - 1)
    start = jnp.where(inner, part.indptr[n], 0)
    return start, jnp.where(inner, part.indptr[n + 1], 0)


def _lookup(part: TriePart, node, token, width: int):
    """The child of node along token (int32, -1 if none or dead): binary search in the CSR row.
    width: a static bound on the row length (sets the number of halvings)."""
    lo, hi = _row(part, node)
    end = hi
    t = token.astype(jnp.int32)
    for _ in range(max(1, int(width).bit_length())):
        mid = (lo + hi) // 2
        go = (lo < hi) & (part.edge_token[jnp.clip(mid, 0, part.edge_token.shape[0] - 1)] < t)
        lo, hi = jnp.where(go, mid + 1, lo), jnp.where(go | (lo >= hi), hi, mid)
    at = jnp.clip(lo, 0, part.edge_token.shape[0] - 1)
    found = (lo < end) & (part.edge_token[at].astype(jnp.int32) == t) & (token >= 0)
    child = jnp.where(found, lo + 1, -1).astype(jnp.int32)
    return jnp.where(_alive(part, child), child, -1)


def _csr_slots(part: TriePart, node, width: int):
    """The first `width` children of each node: (tokens, child states, valid), each [R, width]."""
    start, end = _row(part, node)
    e = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    valid = e < end[:, None]
    tok = part.edge_token[jnp.clip(e, 0, part.edge_token.shape[0] - 1)].astype(jnp.int32)
    child = (e + 1).astype(jnp.int32)
    valid = valid & _alive(part, child)
    return jnp.where(valid, tok, -1), jnp.where(valid, child, -1), valid


# ----------------------------------------------------------------------------- the constraint
@dataclasses.dataclass(frozen=True)
class TrieConstraint:
    """The Constraint protocol over a trie index (module docstring). A pytree: arrays are leaves, the
    rest is static (part of the jit cache key)."""
    parts: tuple  # TriePart, ...
    set_ids: jax.Array | None  # int32[B]: item set of each batch row (None: set 0 for every row)
    token_used: jax.Array  # bool[V_index]: ids that occur in items (to refuse EOS ids among them)
    vocab_size: int  # the index's vocabulary bound (item ids < vocab_size)
    num_sets: int
    max_len: int  # longest item (tokens)
    has_prefix_items: bool
    eos_ids: tuple = ()  # bound by prepare()
    impl: str = "auto"  # constrained_topk implementation
    mesh: object = None  # a Mesh: run the step under shard_map, rows over "data"

    def replace(self, **kw) -> "TrieConstraint":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ host side
    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None) -> "TrieConstraint":
        """Check the constraint against a model / decode call and bind the EOS ids. Raises
        ConstraintError with the fix. Value checks are skipped for traced set_ids."""
        eos_ids = tuple(int(e) for e in eos_ids)
        if self.vocab_size > vocab_size:
            raise ConstraintError(f"the index allows token ids up to {self.vocab_size - 1} but the model's "
                                  f"vocabulary has {vocab_size} ids; build the index with vocab_size <= "
                                  f"{vocab_size}")
        used = concrete(self.token_used)
        if used is not None:
            clash = [e for e in eos_ids if e < used.shape[0] and used[e]]
            if clash:
                raise ConstraintError(f"EOS id {clash[0]} also occurs inside items; an EOS id must only "
                                      "end items (pass other eos_ids or remap the item tokens)")
        if not eos_ids and self.has_prefix_items:
            raise ConstraintError("the index holds items that are prefixes of other items; such items can "
                                  "only end with an EOS token: pass eos_ids")
        need = self.max_len + (1 if eos_ids else 0)
        if max_new_tokens is not None and max_new_tokens < need:
            raise ConstraintError(f"max_new_tokens={max_new_tokens} cannot complete the longest item "
                                  f"({self.max_len} tokens{' + EOS' if eos_ids else ''}); pass "
                                  f"max_new_tokens >= {need}")
        out = self.replace(eos_ids=eos_ids)
        if self.set_ids is not None:
            sets = concrete(self.set_ids)
            if batch is not None and np.shape(self.set_ids) != (batch,):
                raise ConstraintError(f"set_ids has shape {np.shape(self.set_ids)} but the batch has "
                                      f"{batch} rows; pass one item-set id per prompt")
            if sets is not None:
                bad = np.flatnonzero((sets < 0) | (sets >= self.num_sets))
                if bad.size:
                    raise ConstraintError(f"set_ids[{int(bad[0])}] = {int(sets[bad[0]])} is outside "
                                          f"[0, {self.num_sets}) (the index's item sets)")
                roots = np.asarray(jax.device_get(self._roots(jnp.asarray(sets, jnp.int32))))
                empty = np.flatnonzero((roots < 0).all(axis=0))
                if empty.size:
                    raise ConstraintError(f"item set {int(sets[empty[0]])} (row {int(empty[0])}) has no "
                                          "items in the index")
        else:
            roots = np.asarray(jax.device_get(self._roots(jnp.zeros((1,), jnp.int32))))
            if (roots < 0).all():
                raise ConstraintError("item set 0 has no items in the index; pass set_ids")
        return out

    # ------------------------------------------------------------------ protocol
    def _roots(self, sets):
        return jnp.stack([_lookup(p, jnp.zeros_like(sets), sets, max(self.num_sets, 1)) for p in self.parts])

    def init(self, batch: int, beams: int = 1) -> TrieState:
        """Every row (and each of its `beams` beams, rows b*beams + j) at its item set's root."""
        sets = (jnp.zeros((batch,), jnp.int32) if self.set_ids is None
                else jnp.broadcast_to(jnp.asarray(self.set_ids, jnp.int32), (batch,)))
        sets = jnp.repeat(sets, beams)
        roots = self._roots(sets)
        return TrieState(node=tuple(roots[i] for i in range(len(self.parts))), depth=jnp.int32(0))

    def allowed(self, state: TrieState, width: int | None = None):
        """bool[R, width]: the tokens each row may emit next (EOS ids at final states). width defaults to
        the index vocabulary (extended to cover the EOS ids); pass the model's vocabulary size."""
        width = self._mask_width() if width is None else int(width)
        if width < self._mask_width():
            raise ConstraintError(f"width={width} is narrower than the index vocabulary / EOS ids "
                                  f"({self._mask_width()})")
        branches = [lambda node, d=d: self._allowed_at(node, d, width) for d in range(self.max_len + 1)]
        return jax.lax.switch(jnp.clip(state.depth, 0, self.max_len), branches, state.node)

    def _mask_width(self) -> int:
        return max((self.vocab_size,) + tuple(e + 1 for e in self.eos_ids))

    def advance(self, state: TrieState, tokens) -> TrieState:
        """Follow tokens[R]; an EOS id (or a token the row does not allow) leaves the row at -1."""
        tokens = tokens.astype(jnp.int32)
        eos = _is_eos(tokens, self.eos_ids)
        node = tuple(jnp.where(eos, -1, _lookup(p, n, tokens, p.max_width)) for p, n in zip(self.parts, state.node))
        return TrieState(node=node, depth=state.depth + 1)

    def complete(self, state: TrieState):
        """bool[R]: the row's item is finished without emitting more (no EOS ids: a final state)."""
        if self.eos_ids:
            return jnp.zeros(state.node[0].shape, bool)
        return self._final_any(state.node)

    def candidates(self, state: TrieState, logits, num_beams: int, scores=None) -> Candidates:
        """The STATIC step: the best allowed next tokens by log_softmax(logits), enough of them for an
        exact beam step of width num_beams (module docstring). logits: [R, V] (V >= the index's).

        scores: optional f32[R], the rows' running beam scores, rows in consecutive groups of num_beams
        that compete for num_beams places (one beam-search group). Then the selection is per group: one
        top-k over the group's beams x allowed tokens, instead of a top-k per row and another over the
        beams' survivors. Same candidates for the beam step, each winner in its own column of its row,
        and much cheaper where a per-row top-k is slow (many short rows on CPU). Without scores the
        selection is per row (greedy, sampling, a first step whose rows are separate prompts)."""
        if not isinstance(num_beams, numbers.Integral) or num_beams < 1:
            raise ConstraintError(f"num_beams must be an int >= 1, got {num_beams!r}")
        if logits.shape[-1] < self._mask_width():
            raise ConstraintError(f"logits have {logits.shape[-1]} columns, fewer than the index vocabulary / "
                                  f"EOS ids need ({self._mask_width()})")
        r = logits.shape[0]
        ax = None
        if self.mesh is not None:
            ax = row_axis(self.mesh, r)
        if scores is not None:
            if getattr(scores, "shape", None) != (r,):
                raise ConstraintError(f"scores must be f32[{r}] (one running score per row), got "
                                      f"{getattr(scores, 'shape', type(scores))}")
            local_rows = r // self.mesh.shape["data"] if ax is not None else r
            if r % num_beams or local_rows % num_beams:  # a group must not straddle rows or devices
                scores = None
        grouped = scores is not None
        width = max(self._cand_width(d, num_beams, grouped) for d in range(self.max_len + 1))

        def step(parts, node, logits, depth, scores):
            c = self.replace(parts=parts)
            branches = [lambda node, logits, scores, d=d: _pad_cands(
                c._candidates_at(node, logits, d, num_beams, scores), width) for d in range(self.max_len + 1)]
            return jax.lax.switch(jnp.clip(depth, 0, self.max_len), branches, node, logits, scores)

        if self.mesh is None:
            return step(self.parts, state.node, logits, state.depth, scores)
        from jax.sharding import PartitionSpec as P
        in_specs = (jax.tree.map(lambda _: P(), self.parts), tuple(P(ax) for _ in state.node), P(ax, None), P(),
                    None if scores is None else P(ax))
        out_specs = Candidates(logprobs=P(ax, None), tokens=P(ax, None), ends=P(ax, None),
                               next=tuple(P(ax, None) for _ in state.node))
        return shard_map(step, self.mesh, in_specs, out_specs)(self.parts, state.node, logits, state.depth,
                                                                scores)

    def step_to(self, state: TrieState, next_nodes) -> TrieState:
        """The state after each row took a candidate (next_nodes: the chosen `Candidates.next` entries)."""
        return TrieState(node=tuple(next_nodes), depth=state.depth + 1)

    # ------------------------------------------------------------------ per-level work
    def _final_any(self, nodes):
        out = jnp.zeros(nodes[0].shape, bool)
        for p, n in zip(self.parts, nodes):
            out = out | _final(p, n)
        return out

    def _eos_slots(self, nodes):
        """(tokens int32[R, E], valid bool[R, E]) of the EOS ids, allowed at final states."""
        r = nodes[0].shape[0]
        fin = self._final_any(nodes)
        toks = jnp.broadcast_to(jnp.asarray(self.eos_ids, jnp.int32), (r, len(self.eos_ids)))
        valid = jnp.broadcast_to(fin[:, None], toks.shape)
        return jnp.where(valid, toks, -1), valid

    def _mixed(self, lv: int) -> bool:
        """Do the children of level lv (states of level lv + 1) mix leaves and inner states?"""
        kind = 0
        for p in self.parts:
            kind |= p.kind(lv + 1)
        return kind == 3

    def _use_dense(self, lv: int) -> bool:
        if not any(lv in p.dense_levels for p in self.parts) or (not self.eos_ids and self._mixed(lv)):
            return False
        if resolve_impl(self.impl) == "reference":
            # XLA gathers a CSR row cheaply, and its per-row top-k over V costs more than over the row
            # (measured on CPU): the dense mask pays there only for rows that span most of V.
            return 2 * max(p.width(lv) for p in self.parts) >= self.vocab_size
        return True

    def _slot_width(self, lv: int) -> int:
        """Candidate slots per row at level lv: the vocabulary (dense) or the CSR rows + EOS slots."""
        e = len(self.eos_ids)
        if self._use_dense(lv):
            return self.vocab_size + e
        return max(sum(p.width(lv) for p in self.parts) + e, 1)

    def _cand_width(self, d: int, num_beams: int, grouped: bool = False) -> int:
        lv = d + 1
        e = len(self.eos_ids)
        slots = self._slot_width(lv)
        mixed = not self.eos_ids and self._mixed(lv)
        if grouped:  # the group's winners (see _group_select)
            total = num_beams * slots
            return 2 * min(num_beams, total) if mixed else min(num_beams * (1 + e), total)
        if mixed:
            return 2 * min(num_beams, slots)
        return min(num_beams + e, slots)

    def _mask_rows(self, nodes, lv: int, v: int):
        """bool[R, v]: the union of every part's children (dense rows or scattered CSR rows)."""
        r = nodes[0].shape[0]
        mask = jnp.zeros((r, v), bool)
        for p, n in zip(self.parts, nodes):
            if lv in p.dense_levels:
                table = p.dense[p.dense_levels.index(lv)]
                first = p.level_start[lv]
                here = (n >= first) & (n < p.level_start[lv + 1])
                row = table[jnp.clip(n - first, 0, table.shape[0] - 1)] & here[:, None]
                mask = mask | jnp.pad(row, ((0, 0), (0, v - row.shape[1])))
            elif p.width(lv):
                tok, _, valid = _csr_slots(p, n, p.width(lv))
                rows = jnp.broadcast_to(jnp.arange(r)[:, None], tok.shape)
                mask = mask.at[rows, jnp.where(valid, tok, v)].set(True, mode="drop")
        return mask

    def _allowed_at(self, nodes, d: int, width: int):
        mask = self._mask_rows(nodes, d + 1, width)
        if self.eos_ids:
            mask = self._add_eos(mask, nodes)
        return mask

    def _add_eos(self, mask, nodes):
        tok, valid = self._eos_slots(nodes)
        rows = jnp.broadcast_to(jnp.arange(mask.shape[0])[:, None], tok.shape)
        return mask.at[rows, jnp.where(valid, tok, mask.shape[1])].set(True, mode="drop")

    def _next_of(self, nodes, tokens, lv: int):
        """Each part's state after `tokens` from `nodes` (broadcast), -1 for EOS / no candidate, and
        whether taking the token ends the item."""
        eos = _is_eos(tokens, self.eos_ids)
        nxt = tuple(jnp.where(eos | (tokens < 0), -1, _lookup(p, n, tokens, p.width(lv)))
                    for p, n in zip(self.parts, nodes))
        ends = eos if self.eos_ids else self._final_any(nxt) & (tokens >= 0)
        return nxt, ends

    def _candidates_at(self, nodes, logits, d: int, num_beams: int, scores=None) -> Candidates:
        lv = d + 1
        v = logits.shape[-1]
        impl = resolve_impl(self.impl)
        k_out = self._cand_width(d, num_beams, scores is not None)
        if self._use_dense(lv):
            mask = self._mask_rows(nodes, lv, v)
            if self.eos_ids:
                mask = self._add_eos(mask, nodes)
            if scores is not None:
                vals = jnp.where(mask, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), _NEG)
                # Slot = token id; next states and ends only for the winners (a binary search each).
                return self._group_select(vals, None, None, None, nodes, lv, num_beams, scores, k_out)
            vals, tokens = constrained_topk(logits, min(k_out, v), mask=mask, impl=impl)
            nxt, ends = self._next_of(tuple(n[:, None] for n in nodes), tokens, lv)
            return Candidates(logprobs=vals, tokens=tokens, ends=ends, next=nxt)

        # CSR: every part's row, then the EOS slots; a later part's token already offered is dropped.
        toks, nexts = [], [[] for _ in self.parts]
        for i, (p, n) in enumerate(zip(self.parts, nodes)):
            if not p.width(lv):
                continue
            tok, child, valid = _csr_slots(p, n, p.width(lv))
            for q in range(i):  # offered by an earlier part: drop (the earlier slot carries this child)
                tok = jnp.where(_lookup(self.parts[q], nodes[q][:, None], tok, self.parts[q].width(lv)) >= 0,
                                -1, tok)
            for j, (pj, nj) in enumerate(zip(self.parts, nodes)):
                if j == i:
                    nexts[j].append(jnp.where(tok >= 0, child, -1))
                elif j < i:
                    nexts[j].append(jnp.full(tok.shape, -1, jnp.int32))
                else:
                    nexts[j].append(_lookup(pj, nj[:, None], tok, pj.width(lv)))
            toks.append(tok)
        r = nodes[0].shape[0]
        if self.eos_ids:
            tok, _ = self._eos_slots(nodes)
            toks.append(tok)
            for j in range(len(self.parts)):
                nexts[j].append(jnp.full(tok.shape, -1, jnp.int32))
        if not toks:  # nothing below this level and no EOS: no candidates at all
            toks.append(jnp.full((r, 1), -1, jnp.int32))
            for j in range(len(self.parts)):
                nexts[j].append(jnp.full((r, 1), -1, jnp.int32))
        tok = jnp.concatenate(toks, axis=1)  # [R, C]
        nxt = tuple(jnp.concatenate(x, axis=1) for x in nexts)
        if self.eos_ids:
            ends = _is_eos(tok, self.eos_ids)
        else:
            ends = self._final_any(nxt) & (tok >= 0)
        c = tok.shape[1]
        if scores is not None:
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [R, V]
            ok = (tok >= 0) & (tok < v)
            vals = jnp.where(ok, jnp.take_along_axis(logp, jnp.where(ok, tok, 0), axis=1), _NEG)
            return self._group_select(vals, tok, ends, nxt, nodes, lv, num_beams, scores, k_out)
        if not self.eos_ids and self._mixed(lv):  # best num_beams of each kind
            kk = min(num_beams, c)
            va, sa = constrained_topk(logits, kk, candidates=jnp.where(ends, -1, tok), impl=impl)
            vb, sb = constrained_topk(logits, kk, candidates=jnp.where(ends, tok, -1), impl=impl)
            vals, slots = jnp.concatenate([va, vb], axis=1), jnp.concatenate([sa, sb], axis=1)
        else:
            vals, slots = constrained_topk(logits, min(k_out, c), candidates=tok, impl=impl)
        safe = jnp.maximum(slots, 0)

        def pick(a, fill):
            return jnp.where(slots >= 0, jnp.take_along_axis(a, safe, axis=1), fill)

        return Candidates(logprobs=vals, tokens=pick(tok, -1), ends=pick(ends, False),
                          next=tuple(pick(x, -1) for x in nxt))

    def _group_select(self, vals, tok, ends, nxt, nodes, lv: int, num_beams: int, scores, n_top: int):
        """Beam-group selection. vals / tok: [R, W] every row's allowed slots (log-prob, token id; -inf /
        -1 = none; tok None: the slot is the token id); ends / nxt: bool[R, W] / per part int32[R, W],
        or both None (then computed for the winners only); rows in groups of num_beams, scores f32[R].

        Returns the group's n_top best (scores + vals) slots, winner j in column j of its own row (the
        other rows of the group hold no candidate there). That set is all the beam step uses: its best
        num_beams, and its best num_beams that do not end, which lie among the best num_beams x (1 + E)
        (a row offers at most E ending EOS slots); without EOS ids only a level that mixes leaves and
        inner states has both kinds, and then the best num_beams of each are kept. Ties: lower row,
        then lower slot, as the per-row path."""
        r, w = vals.shape
        kg = num_beams
        g = r // kg
        total = (scores[:, None] + vals).reshape(g, kg * w)
        mixed = not self.eos_ids and self._mixed(lv)
        if mixed:
            # (ends is given here: a dense level never mixes leaves and inner states without EOS ids.)
            flat_end = ends.reshape(g, kg * w)
            half = n_top // 2
            ta, ia = jax.lax.top_k(jnp.where(flat_end, _NEG, total), half)
            tb, ib = jax.lax.top_k(jnp.where(flat_end, total, _NEG), half)
            top, idx = jnp.concatenate([ta, tb], axis=1), jnp.concatenate([ia, ib], axis=1)
        else:
            top, idx = jax.lax.top_k(total, n_top)  # [G, n]
        parent = idx // w  # beam within the group
        win_row = jnp.arange(g)[:, None] * kg + parent  # [G, n] global row
        win_tok = idx % w if tok is None else jnp.take_along_axis(tok.reshape(g, kg * w), idx, axis=1)
        ok = (top > _NEG) & (win_tok >= 0)
        win_tok = jnp.where(ok, win_tok, -1)
        win_val = jnp.where(ok, jnp.take_along_axis(vals.reshape(g, kg * w), idx, axis=1), _NEG)
        if nxt is None:
            win_next, win_end = self._next_of(tuple(n[win_row] for n in nodes), win_tok, lv)
        else:
            win_next = tuple(jnp.where(ok, jnp.take_along_axis(x.reshape(g, kg * w), idx, axis=1), -1)
                             for x in nxt)
            win_end = jnp.take_along_axis(ends.reshape(g, kg * w), idx, axis=1) & ok
        own = (parent[:, None, :] == jnp.arange(kg)[None, :, None]) & ok[:, None, :]  # [G, Kg, n]

        def spread(a, fill):  # [G, n] -> [R, n]: winner j in column j of its row
            return jnp.where(own, a[:, None, :], fill).reshape(r, -1)

        return Candidates(logprobs=spread(win_val, _NEG), tokens=spread(win_tok, -1),
                          ends=spread(win_end, False), next=tuple(spread(x, -1) for x in win_next))


jax.tree_util.register_dataclass(
    TrieConstraint, data_fields=["parts", "set_ids", "token_used"],
    meta_fields=["vocab_size", "num_sets", "max_len", "has_prefix_items", "eos_ids", "impl", "mesh"])


def _pad_cands(c: Candidates, width: int) -> Candidates:
    """Pad the candidate axis to a common width (lax.switch branches must agree on shapes)."""
    extra = width - c.tokens.shape[1]
    if extra == 0:
        return c

    def pad(a, fill):
        return jnp.pad(a, ((0, 0), (0, extra)), constant_values=fill)

    return Candidates(logprobs=pad(c.logprobs, _NEG), tokens=pad(c.tokens, -1), ends=pad(c.ends, False),
                      next=tuple(pad(x, -1) for x in c.next))


def _is_eos(tokens, eos_ids: tuple):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, tokens.dtype), axis=-1)


def part_from_index(index, *, final_bits=None, alive_bits=None, dense=None, bucket_levels: int | None = None,
                    device_csr=None) -> TriePart:
    """Device arrays of a TrieIndex (optionally with updated final bits / alive bits / dense tables).

    bucket_levels: for a trie that changes often (the delta of a DynamicIndex): pad the arrays to
    power-of-two capacities, the row widths to powers of two and the levels to `bucket_levels`, so
    that successive versions share shapes and static metadata and a jit-compiled decoder does not
    recompile for each one. Wider bounds stay exact (slots past a row's end are invalid).
    device_csr: (edge_token, indptr) already on the device, reused instead of uploading them again.
    """
    dense = index.dense if dense is None else dense
    levels = tuple(sorted(dense))
    n_levels = index.num_levels
    kinds, widths = [], list(index.level_width)
    for lv in range(n_levels):
        leaves, n = index.level_leaves[lv], index.level_size(lv)
        kinds.append((1 if leaves else 0) | (2 if leaves < n else 0))
    edge_token, indptr = index.edge_token, index.indptr
    final = index.final_bits if final_bits is None else final_bits
    starts = list(index.level_start)
    if bucket_levels is not None:
        if dense:
            raise ValueError("a bucketed part has no dense tables")
        n_levels = max(n_levels, int(bucket_levels))
        widths = [next_pow2(w) if w else 0 for w in widths] + [0] * (n_levels - len(widths))
        kinds = kinds + [0] * (n_levels - len(kinds))
        starts = starts + [starts[-1]] * (n_levels + 1 - len(starts))
        e = edge_token.shape[0]
        cap = next_pow2(max(e, 64))
        edge_token = np.pad(edge_token, (0, cap - e))
        # Every state past the real ones (and the deepest level) gets an empty row [E, E].
        indptr = np.pad(indptr, (0, cap + 1 - indptr.shape[0] + 1), constant_values=e)
        final = np.pad(final, (0, (cap + 1 + 7) // 8 - final.shape[0]))
    if device_csr is not None:
        edge_token, indptr = device_csr
    return TriePart(edge_token=jnp.asarray(edge_token), indptr=jnp.asarray(indptr),
                    final_bits=jnp.asarray(final), alive_bits=None if alive_bits is None else jnp.asarray(alive_bits),
                    dense=tuple(jnp.asarray(dense[lv]) for lv in levels),
                    level_start=jnp.asarray(np.asarray(starts, np.int64), jnp.int32),
                    level_width=tuple(int(w) for w in widths), level_kind=tuple(kinds), dense_levels=levels)


def make_constraint(parts, *, vocab_size: int, num_sets: int, max_len: int, has_prefix_items: bool,
                    token_used, set_ids=None, impl: str = "auto", mesh=None) -> TrieConstraint:
    if set_ids is not None:
        set_ids = np.asarray(set_ids) if not isinstance(set_ids, jax.Array) else set_ids
        if np.ndim(set_ids) != 1:
            raise ConstraintError(f"set_ids must be a 1-D list of item-set ids (one per batch row), got "
                                  f"shape {np.shape(set_ids)}")
        set_ids = jnp.asarray(set_ids, jnp.int32)
    resolve_impl(impl)
    return TrieConstraint(parts=tuple(parts), set_ids=set_ids, token_used=jnp.asarray(token_used),
                          vocab_size=int(vocab_size), num_sets=int(num_sets), max_len=int(max_len),
                          has_prefix_items=bool(has_prefix_items), impl=impl, mesh=mesh)


def constraint_from_index(index, *, set_ids=None, impl: str = "auto", mesh=None) -> TrieConstraint:
    """The TrieConstraint of a TrieIndex (uploads its arrays)."""
    return make_constraint([part_from_index(index)], vocab_size=index.vocab_size, num_sets=index.num_sets,
                           max_len=index.max_len, has_prefix_items=index.has_prefix_items,
                           token_used=index.token_used, set_ids=set_ids, impl=impl, mesh=mesh)


__all__ = ["Candidates", "ConstraintError", "TrieConstraint", "TriePart", "TrieState", "constraint_from_index",
           "make_constraint", "part_from_index"]
