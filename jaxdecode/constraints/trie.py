"""The trie constraint on the device: the Constraint protocol of DESIGN.md over one or more CSR tries.

    c = index.constraint(set_ids=None)           # a TrieConstraint (a pytree: pass it into jit)
    c = c.prepare(vocab_size, eos_ids, max_new_tokens, batch)    # host checks, binds the EOS ids
    state = c.init(batch)                        # TrieState: each row at its item set's root
    mask = c.allowed(state)                      # bool[R, V]     (greedy / sampling: mask the logits)
    state = c.advance(state, tokens)             # follow the chosen tokens
    cands = c.candidates(state, logits, k)       # the STATIC beam step: each row's k best allowed
                                                 # tokens with log-probs, end flags and next states
    cands = c.candidates(state, logits, k, scores=run_scores)   # ... ranked per group of k beams
    state = c.step_to(state, next_nodes)         # beams picked their candidates

Inside jit. Every method is a pure function of the pytree (arrays: the tries and set_ids; static: the
level widths, kinds, EOS ids, implementation), so decoders run with the constraint as a traced
argument of the caller's jax.jit. `prepare` runs on the host only, from facts copied when the
constraint is built (`HostFacts`: item tokens, non-empty sets, the set ids), so a decode call does no
device op and no transfer before its compiled loop; the facts are not part of the pytree, so value
checks are skipped for a flattened (traced) constraint.

State. `TrieState.node` holds one int32[R] array of trie states per part (-1 = not in that part);
`depth` is the number of item tokens emitted so far, the same for every row because every row advances
one level per step. A node of -1 in every part is a finished (or dead) row. The level loop needs static
row widths, so every depth-dependent op is a `lax.switch` over compiled variants of the step, each with
static row widths (the STATIC per-level `max_branch_factors`): a dense level is its own variant, CSR
levels whose widths round to the same power of two (all rows up to 8 wide together) share one at
their widest rows. A wider bound is exact (slots past a row's end are invalid) and a handful of
variants compile much faster than one per depth.

Ends. With EOS ids bound (`prepare(..., eos_ids)`), an item ends by emitting an EOS id, which is
allowed exactly at final states (so an item may be a prefix of another). Without EOS ids, an item ends
when its row reaches a final state, which must then be a leaf: indexes with prefix items need EOS ids
(`prepare` says so). Either way every hypothesis a decoder finishes is an item of the row's set.

Parts. A plain index is one part. `DynamicIndex` (added / removed items without a rebuild) is two: the
base trie with `alive_bits` (a state whose every item was removed is skipped) and an updated copy of
its final bits and dense tables, and a small delta trie of added items. A step takes the union: every
part's CSR row, a delta token already offered by the base dropped, and the other part's next state
found by a search in its row. Per-request item sets live in one index as different set roots
(`index.build_index(..., set_ids=...)`); `set_ids` here says which set each batch row decodes from.

Candidate selection per level (exact for beam search): the beam step needs, from every row, the best
`num_beams` non-ending candidates and the best `num_beams` ending ones. With EOS ids, at most E slots
end, so the row's top num_beams + E suffices; without them, a level whose children are all leaves or
all inner nodes needs the top num_beams, and a level that mixes both (variable-length items) takes the
top num_beams of each kind. Dense levels (index.dense) use the mask form of the kernel, the others the
CSR candidate form (`jaxdecode.kernels.constrained.constrained_topk`). With `scores` (beam search
without a diversity penalty) the rows' winners are then ranked per group of num_beams beams (one top-k
over the group's beams x winners), and the beam step takes the group's list as it is. On GPU / TPU the
kernel picks each row's winners, so the [R, V] log-probs are never built; on the pure-jnp reference
path (CPU) the group's top-k runs directly over every allowed slot's log-prob (cheaper there than a
per-row top-k), and only levels whose rows span at least half the vocabulary use the mask.
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.index import get_bits
from jaxdecode.kernels.common import concrete, next_pow2, shard_map
from jaxdecode.kernels.constrained import constrained_topk, resolve_impl, row_axis

_NEG = float("-inf")
_SHARED_WIDTH = 8  # CSR levels with rows up to this wide share one compiled variant of the step
_FANOUT = 16  # the search in a CSR row probes _FANOUT - 1 slots per step


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
    parent: jax.Array | None = None  # grouped selection (rows are beam groups): int32[G, C], the beam of
    # the group (0 .. num_beams - 1) that the candidate extends; None: per row

    def pad_to(self, width: int) -> "Candidates":
        """The candidate axis padded with no-candidate slots to `width` (at least its current width)."""
        extra = width - self.tokens.shape[-1]
        if extra <= 0:
            return self

        def pad(a, fill):
            return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)], constant_values=fill)

        return Candidates(logprobs=pad(self.logprobs, _NEG), tokens=pad(self.tokens, -1), ends=pad(self.ends, False),
                          next=tuple(pad(x, -1) for x in self.next),
                          parent=None if self.parent is None else pad(self.parent, 0))


jax.tree_util.register_dataclass(Candidates, data_fields=["logprobs", "tokens", "ends", "next", "parent"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class _Level:
    """Static shape of one compiled variant of the step: each part's row width bound, whether the
    children mix leaves and inner states (no EOS ids), and the dense level it reads (None: CSR rows)."""
    widths: tuple
    mixed: bool
    dense: int | None = None

    def replace(self, **kw) -> "_Level":
        return dataclasses.replace(self, **kw)


def _switch(branch_of, depth, branches, *args):
    """branches[variant of depth](*args); branch_of = (first depth, variant of each depth from there)."""
    if len(branches) == 1:
        return branches[0](*args)
    lo, table = branch_of
    i = jnp.asarray(table, jnp.int32)[jnp.clip(depth - lo, 0, len(table) - 1)]
    return jax.lax.switch(i, branches, *args)


# ----------------------------------------------------------------------------- trie primitives
def _at(arr, idx):
    """arr[idx] for a 1-D arr as one bare XLA gather: out-of-range indices clamp (XLA's rule), so no
    negative-index wrapping or clipping ops around it (they multiply in the unrolled searches)."""
    return jnp.take(arr, idx, mode="clip")


def _bit(bits, idx):
    """bool[...]: bit idx (>= 0) of a little-endian packed uint8 array."""
    i = jnp.maximum(idx, 0)
    return ((_at(bits, i >> 3) >> (i & 7).astype(jnp.uint8)) & 1).astype(bool)


def _final(part: TriePart, node):
    return (node >= 0) & _bit(part.final_bits, node)


def _alive(part: TriePart, node):
    ok = node >= 0
    return ok if part.alive_bits is None else ok & _bit(part.alive_bits, node)


def _row(part: TriePart, node):
    """(start, end) edge range of each node's children; empty for -1 and childless deepest states."""
    inner = (node >= 0) & (node < part.n_inner)
    start = jnp.where(inner, _at(part.indptr, node), 0)
    return start, jnp.where(inner, _at(part.indptr, node + 1), 0)


def _lookup(part: TriePart, node, token, width: int):
    """The child of node along token (int32, -1 if none or dead): a search in the CSR row.
    width: a static bound on the row length (sets the number of steps).

    A 16-ary search: `last` is the last slot known to hold a token < t; each step probes 15 slots at a
    stride (256, 16, 1, ... as the width needs) and moves `last` past those in the row and below t. A
    row of up to 15 is one vector compare, 2048 three steps. (A binary search is a chain of ~log2(W)
    dependent steps, and XLA re-computes the whole chain inside every step's fused gather: its code
    grows with the square of the chain, and compile time with it.)"""
    start, end = _row(part, node)
    t = token.astype(jnp.int32)[..., None]
    width = max(int(width), 1)
    span = 1
    while span * _FANOUT < width + 1:
        span *= _FANOUT
    q = jnp.arange(1, min(_FANOUT, width + 1), dtype=jnp.int32)  # a single step needs only `width` probes
    last = start - 1
    while span >= 1:
        probe = last[..., None] + span * q
        below = (probe < end[..., None]) & (_at(part.edge_token, probe) < t)
        last = last + span * jnp.sum(below, axis=-1, dtype=jnp.int32)
        span //= _FANOUT
    at = last + 1
    found = (at < end) & (_at(part.edge_token, at).astype(jnp.int32) == t[..., 0]) & (token >= 0)
    child = jnp.where(found, at + 1, -1).astype(jnp.int32)
    return jnp.where(_alive(part, child), child, -1)


def _csr_slots(part: TriePart, node, width: int):
    """The first `width` children of each node: (tokens, child states, valid), each [R, width]."""
    start, end = _row(part, node)
    e = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    valid = e < end[:, None]
    tok = _at(part.edge_token, e).astype(jnp.int32)
    child = (e + 1).astype(jnp.int32)
    valid = valid & _alive(part, child)
    return jnp.where(valid, tok, -1), jnp.where(valid, child, -1), valid


# ----------------------------------------------------------------------------- the constraint
@dataclasses.dataclass(frozen=True, eq=False)
class HostFacts:
    """What prepare() checks values against, kept on the host when the constraint is built (the index
    holds NumPy arrays), so a decode call never copies from the device to check its input."""
    token_used: np.ndarray  # bool[V_index]: ids that occur in items (EOS ids must not)
    set_has_items: np.ndarray  # bool[num_sets]: the set holds at least one (live) item
    set_ids_src: object = None  # the set_ids array these facts describe ...
    set_ids: np.ndarray | None = None  # ... and its host copy (None: not available, e.g. traced)

    def sets_of(self, set_ids):
        """Host int64 copy of a constraint's set_ids (zeros(1) for None); None when not on the host
        without a device->host copy (a traced array, or a device array other than the one the constraint
        was built with)."""
        if set_ids is None:
            return np.zeros(1, np.int64)
        if set_ids is self.set_ids_src and self.set_ids is not None:
            return self.set_ids
        if isinstance(set_ids, np.ndarray):
            return set_ids.astype(np.int64)
        return None


def host_set_ids(set_ids):
    """int64 host copy of set_ids when it has a value: a NumPy array / list, or a concrete jax array
    (copied once, when a constraint is built); None for a tracer."""
    out = concrete(set_ids)
    return None if out is None else np.asarray(out, np.int64)


@dataclasses.dataclass(frozen=True)
class TrieConstraint:
    """The Constraint protocol over a trie index (module docstring). A pytree: arrays are leaves, the
    rest is static (part of the jit cache key)."""
    parts: tuple  # TriePart, ...
    set_ids: jax.Array | None  # int32[B]: item set of each batch row (None: set 0 for every row)
    vocab_size: int  # the index's vocabulary bound (item ids < vocab_size)
    num_sets: int
    max_len: int  # longest item (tokens)
    has_prefix_items: bool
    eos_ids: tuple = ()  # bound by prepare()
    impl: str = "auto"  # constrained_topk implementation
    mesh: object = None  # a Mesh: run the step under shard_map, rows over "data"
    host: HostFacts | None = None  # host copies for prepare()'s checks; not part of the pytree (None
    # after flattening: inside jit, or after jax.tree.map)

    def replace(self, **kw) -> "TrieConstraint":
        if "set_ids" in kw and "host" not in kw and self.host is not None:  # keep the host facts true
            kw["host"] = dataclasses.replace(self.host, set_ids_src=kw["set_ids"], set_ids=host_set_ids(kw["set_ids"]))
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ host side
    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None) -> "TrieConstraint":
        """Check the constraint against a model / decode call and bind the EOS ids. Raises
        ConstraintError with the fix.

        Runs on the host only, from facts taken when the constraint was built (`host`): no device op and
        no transfer, so it costs microseconds per call and works on a traced constraint. The checks of
        values (EOS ids among the item tokens, set ids in range and non-empty) need those facts; they
        are skipped when the constraint was flattened (a traced argument of jit, jax.tree.map): call
        prepare() once outside jit to run them. Shape, vocabulary and length checks always run."""
        eos_ids = tuple(int(e) for e in eos_ids)
        if self.vocab_size > vocab_size:
            raise ConstraintError(f"the index allows token ids up to {self.vocab_size - 1} but the model's "
                                  f"vocabulary has {vocab_size} ids; build the index with vocab_size <= "
                                  f"{vocab_size}")
        host = self.host
        if host is not None:
            clash = [e for e in eos_ids if 0 <= e < host.token_used.shape[0] and host.token_used[e]]
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
        if self.set_ids is not None and batch is not None and np.shape(self.set_ids) != (batch,):
            raise ConstraintError(f"set_ids has shape {np.shape(self.set_ids)} but the batch has "
                                  f"{batch} rows; pass one item-set id per prompt")
        if host is not None:
            sets = host.sets_of(self.set_ids)
            if sets is not None and sets.size:
                if sets.min() < 0 or sets.max() >= self.num_sets:
                    bad = np.flatnonzero((sets < 0) | (sets >= self.num_sets))
                    raise ConstraintError(f"set_ids[{int(bad[0])}] = {int(sets[bad[0]])} is outside "
                                          f"[0, {self.num_sets}) (the index's item sets)")
                has = host.set_has_items[sets]
                if not has.all():
                    empty = np.flatnonzero(~has)
                    if self.set_ids is None:
                        raise ConstraintError("item set 0 has no items in the index; pass set_ids")
                    raise ConstraintError(f"item set {int(sets[empty[0]])} (row {int(empty[0])}) has no "
                                          "items in the index")
        return self.replace(eos_ids=eos_ids)

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
        specs, branch_of = self._branches(0, self.max_len, for_mask=True)
        branches = [lambda node, s=s: self._allowed_at(node, s, width) for s in specs]
        return _switch(branch_of, state.depth, branches, state.node)

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

    def candidates(self, state: TrieState, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None) -> Candidates:
        """The STATIC step: the best allowed next tokens by log_softmax(logits), enough of them for an
        exact beam step of width num_beams (module docstring). logits: [R, V] (V >= the index's).

        Without scores the selection is per row: Candidates [R, C] (greedy, sampling, a first step whose
        rows are separate prompts, Diverse Beam Search). scores: optional f32[R], the rows' running beam
        scores, rows in consecutive groups of num_beams that compete for num_beams places (one beam-search
        group). Then the selection is per group: Candidates [R / num_beams, n], the group's n best
        (score + log-prob) allowed continuations, best first, with `parent` the beam (0..num_beams-1)
        each extends: all a beam step needs, and no second top-k over beams x candidates. (When a group
        would straddle devices of the mesh, the result is per row, parent None.)

        min_depth / max_depth: static bounds on state.depth (a beam loop's body never sees depth 0, its
        first step only depth 0): levels outside them are not compiled."""
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
        specs, branch_of = self._branches(min_depth, self.max_len if max_depth is None else max_depth)
        width = max(self._out_width(s, num_beams, grouped) for s in specs)

        def step(parts, node, logits, depth, scores):
            c = self.replace(parts=parts)
            branches = [lambda node, logits, scores, s=s: _pad_cands(
                c._candidates_at(node, logits, s, num_beams, scores), width) for s in specs]
            return _switch(branch_of, depth, branches, node, logits, scores)

        if self.mesh is None:
            return step(self.parts, state.node, logits, state.depth, scores)
        from jax.sharding import PartitionSpec as P
        in_specs = (jax.tree.map(lambda _: P(), self.parts), tuple(P(ax) for _ in state.node), P(ax, None), P(),
                    None if scores is None else P(ax))
        out_specs = Candidates(logprobs=P(ax, None), tokens=P(ax, None), ends=P(ax, None),
                               next=tuple(P(ax, None) for _ in state.node),
                               parent=P(ax, None) if grouped else None)
        return shard_map(step, self.mesh, in_specs, out_specs)(self.parts, state.node, logits, state.depth,
                                                                scores)

    def step_to(self, state: TrieState, next_nodes) -> TrieState:
        """The state after each row took a candidate (next_nodes: the chosen `Candidates.next` entries)."""
        return TrieState(node=tuple(next_nodes), depth=state.depth + 1)

    # ------------------------------------------------------------------ levels
    def _level(self, lv: int, for_mask: bool = False) -> _Level:
        """The static description of the step out of internal level lv (item depth lv - 1). A mask
        (greedy, sampling) reads the dense tables wherever they exist; the candidate step where they pay
        (_use_dense)."""
        widths = tuple(p.width(lv) for p in self.parts)
        mixed = not self.eos_ids and self._mixed(lv)
        dense = any(lv in p.dense_levels for p in self.parts) if for_mask else self._use_dense(lv)
        return _Level(widths=widths, mixed=mixed, dense=lv if dense else None)

    def _branches(self, lo: int, hi: int, for_mask: bool = False) -> tuple[list, tuple]:
        """The compiled variants of the step for item depths lo..hi and the variant of each depth.

        A level with dense tables is its own variant; CSR levels share one when they agree on mixing and
        on the power of two that bounds each part's row width (rows up to _SHARED_WIDTH wide all share),
        and it runs at their widest rows (a wider bound is exact: slots past a row's end are invalid).
        1e5 random items of length 8 over V = 2048 then compile three variants instead of nine (roots
        over V, rows of ~70, rows of 1-3), at the price of a few padded slots per row."""
        lo, hi = max(0, lo), min(self.max_len, hi)
        specs, keys, branch_of = [], {}, []
        for d in range(lo, hi + 1):
            s = self._level(d + 1, for_mask)
            key = (s.dense,) if s.dense is not None else (None, s.mixed) + tuple(
                next_pow2(max(w, _SHARED_WIDTH)) for w in s.widths)
            if key not in keys:
                keys[key] = len(specs)
                specs.append(s)
            else:
                i = keys[key]
                specs[i] = specs[i].replace(widths=tuple(map(max, specs[i].widths, s.widths)))
            branch_of.append(keys[key])
        return specs, (lo, tuple(branch_of))

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

    def _slot_width(self, s: _Level) -> int:
        """Candidate slots per row: the vocabulary (dense) or the CSR rows + EOS slots."""
        e = len(self.eos_ids)
        if s.dense is not None:
            return self.vocab_size + e
        return max(sum(s.widths) + e, 1)

    def _row_width(self, s: _Level, num_beams: int) -> int:
        """Per-row candidates for an exact beam step: the best num_beams + E (a row offers at most E
        ending slots, so they hold its best num_beams that do not end), or num_beams of each kind at a
        level that mixes leaves and inner states without EOS ids."""
        slots = self._slot_width(s)
        if s.mixed:
            return 2 * min(num_beams, slots)
        return min(num_beams + len(self.eos_ids), slots)

    def _out_width(self, s: _Level, num_beams: int, grouped: bool) -> int:
        if not grouped:
            return self._row_width(s, num_beams)
        # The group's winners (see _group_select) from the rows' slots (reference) or the rows' kernel
        # winners: the best num_beams x (1 + E), or num_beams of each kind.
        total = num_beams * (self._slot_width(s) if self._select_in_xla() else self._row_width(s, num_beams))
        return 2 * min(num_beams, total) if s.mixed else min(num_beams * (1 + len(self.eos_ids)), total)

    def _select_in_xla(self) -> bool:
        """Is the grouped selection one XLA top-k over the rows' full slots (the reference path), or does
        the kernel first pick each row's winners (GPU / TPU, interpret)?"""
        return resolve_impl(self.impl) == "reference"

    def _mask_rows(self, nodes, s: _Level, v: int):
        """bool[R, v]: the union of every part's children (dense rows or scattered CSR rows)."""
        r = nodes[0].shape[0]
        mask = jnp.zeros((r, v), bool)
        lv = s.dense
        for p, n, w in zip(self.parts, nodes, s.widths):
            if lv is not None and lv in p.dense_levels:
                table = p.dense[p.dense_levels.index(lv)]
                first = p.level_start[lv]
                here = (n >= first) & (n < p.level_start[lv + 1])
                row = table[jnp.clip(n - first, 0, table.shape[0] - 1)] & here[:, None]
                mask = mask | jnp.pad(row, ((0, 0), (0, v - row.shape[1])))
            elif w:
                tok, _, valid = _csr_slots(p, n, w)
                rows = jnp.broadcast_to(jnp.arange(r)[:, None], tok.shape)
                mask = mask.at[rows, jnp.where(valid, tok, v)].set(True, mode="drop")
        return mask

    def _allowed_at(self, nodes, s: _Level, width: int):
        mask = self._mask_rows(nodes, s, width)
        if self.eos_ids:
            mask = self._add_eos(mask, nodes)
        return mask

    def _add_eos(self, mask, nodes):
        tok, valid = self._eos_slots(nodes)
        rows = jnp.broadcast_to(jnp.arange(mask.shape[0])[:, None], tok.shape)
        return mask.at[rows, jnp.where(valid, tok, mask.shape[1])].set(True, mode="drop")

    def _next_of(self, nodes, tokens, s: _Level):
        """Each part's state after `tokens` from `nodes` (broadcast), -1 for EOS / no candidate, and
        whether taking the token ends the item."""
        eos = _is_eos(tokens, self.eos_ids)
        nxt = tuple(jnp.where(eos | (tokens < 0), -1, _lookup(p, n, tokens, w))
                    for p, n, w in zip(self.parts, nodes, s.widths))
        ends = eos if self.eos_ids else self._final_any(nxt) & (tokens >= 0)
        return nxt, ends

    def _csr_candidates(self, nodes, s: _Level):
        """Every part's CSR row, then the EOS slots; a later part's token already offered by an earlier
        part is dropped (the earlier slot carries its child). (tokens int32[R, C], next states per part,
        ends bool[R, C])."""
        toks, nexts = [], [[] for _ in self.parts]
        for i, (p, n, w) in enumerate(zip(self.parts, nodes, s.widths)):
            if not w:
                continue
            tok, child, _ = _csr_slots(p, n, w)
            for q in range(i):
                tok = jnp.where(_lookup(self.parts[q], nodes[q][:, None], tok, s.widths[q]) >= 0, -1, tok)
            for j, (pj, nj) in enumerate(zip(self.parts, nodes)):
                if j == i:
                    nexts[j].append(jnp.where(tok >= 0, child, -1))
                elif j < i:
                    nexts[j].append(jnp.full(tok.shape, -1, jnp.int32))
                else:
                    nexts[j].append(_lookup(pj, nj[:, None], tok, s.widths[j]))
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
        ends = _is_eos(tok, self.eos_ids) if self.eos_ids else self._final_any(nxt) & (tok >= 0)
        return tok, nxt, ends

    def _candidates_at(self, nodes, logits, s: _Level, num_beams: int, scores=None) -> Candidates:
        v = logits.shape[-1]
        impl = resolve_impl(self.impl)
        grouped = scores is not None
        if grouped and self._select_in_xla():
            # XLA path (CPU): one top-k over the group's beams x every allowed slot, from the [R, V]
            # log-probs; a per-row top-k first would cost more there (many short rows).
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [R, V]
            if s.dense is not None:
                mask = self._mask_rows(nodes, s, v)
                if self.eos_ids:
                    mask = self._add_eos(mask, nodes)
                # Slot = token id; next states and ends only for the winners (a binary search each).
                return self._group_select(jnp.where(mask, logp, _NEG), None, None, None, nodes, s, num_beams,
                                          scores)
            tok, nxt, ends = self._csr_candidates(nodes, s)
            ok = (tok >= 0) & (tok < v)
            vals = jnp.where(ok, jnp.take_along_axis(logp, jnp.where(ok, tok, 0), axis=1, mode="clip"), _NEG)
            return self._group_select(vals, tok, ends, nxt, nodes, s, num_beams, scores)

        # Per row: the kernel (or its reference) picks each row's best allowed tokens from the logits, the
        # log-softmax normaliser computed on the fly; grouped, the group's top-k then ranks those winners.
        k_row = self._row_width(s, num_beams)
        if s.dense is not None:
            mask = self._mask_rows(nodes, s, v)
            if self.eos_ids:
                mask = self._add_eos(mask, nodes)
            vals, tokens = constrained_topk(logits, min(k_row, v), mask=mask, impl=impl)
            nxt, ends = self._next_of(tuple(n[:, None] for n in nodes), tokens, s)
            ends = ends & (tokens >= 0)
        else:
            tok, nxt, ends = self._csr_candidates(nodes, s)
            c = tok.shape[1]
            if s.mixed:  # best num_beams of each kind
                kk = min(num_beams, c)
                va, sa = constrained_topk(logits, kk, candidates=jnp.where(ends, -1, tok), impl=impl)
                vb, sb = constrained_topk(logits, kk, candidates=jnp.where(ends, tok, -1), impl=impl)
                vals, slots = jnp.concatenate([va, vb], axis=1), jnp.concatenate([sa, sb], axis=1)
            else:
                vals, slots = constrained_topk(logits, min(k_row, c), candidates=tok, impl=impl)
            safe = jnp.maximum(slots, 0)

            def pick(a, fill):
                return jnp.where(slots >= 0, jnp.take_along_axis(a, safe, axis=1, mode="clip"), fill)

            tokens, ends, nxt = pick(tok, -1), pick(ends, False), tuple(pick(x, -1) for x in nxt)
        if grouped:
            return self._group_select(vals, tokens, ends, nxt, nodes, s, num_beams, scores)
        return Candidates(logprobs=vals, tokens=tokens, ends=ends, next=nxt)

    def _group_select(self, vals, tok, ends, nxt, nodes, s: _Level, num_beams: int, scores) -> Candidates:
        """Beam-group selection. vals / tok: [R, W] every row's allowed slots (log-prob, token id; -inf /
        -1 = none; tok None: the slot is the token id); ends / nxt: bool[R, W] / per part int32[R, W],
        or both None (then computed for the winners only); rows in groups of num_beams, scores f32[R].

        Returns the group's n best (scores + vals) slots, best first, as Candidates [G, n] with `parent`
        the beam each extends. That set is all the beam step uses: its best num_beams, and its best
        num_beams that do not end, which lie among the best num_beams x (1 + E) (a row offers at most E
        ending EOS slots); without EOS ids only a level that mixes leaves and inner states has both
        kinds, and then the best num_beams of each are kept (two sorted halves). Ties: lower row, then
        lower slot, as the per-row path."""
        r, w = vals.shape
        kg = num_beams
        g = r // kg
        n_top = min(self._out_width(s, kg, True), kg * w)
        total = (scores[:, None] + vals).reshape(g, kg * w)
        if s.mixed:
            # (ends is given here: a dense level never mixes leaves and inner states without EOS ids.)
            flat_end = ends.reshape(g, kg * w)
            half = n_top // 2
            ta, ia = jax.lax.top_k(jnp.where(flat_end, _NEG, total), half)
            tb, ib = jax.lax.top_k(jnp.where(flat_end, total, _NEG), half)
            top, idx = jnp.concatenate([ta, tb], axis=1), jnp.concatenate([ia, ib], axis=1)
        else:
            top, idx = jax.lax.top_k(total, n_top)  # [G, n]
        parent = (idx // w).astype(jnp.int32)  # beam within the group

        def take(a):
            return jnp.take_along_axis(a.reshape(g, kg * w), idx, axis=1, mode="clip")

        win_tok = idx % w if tok is None else take(tok)
        ok = (top > _NEG) & (win_tok >= 0)
        win_tok = jnp.where(ok, win_tok, -1).astype(jnp.int32)
        win_val = jnp.where(ok, take(vals), _NEG)
        if nxt is None:
            win_row = jnp.arange(g)[:, None] * kg + parent  # [G, n] global row
            win_next, win_end = self._next_of(tuple(n[win_row] for n in nodes), win_tok, s)
        else:
            win_next = tuple(jnp.where(ok, take(x), -1) for x in nxt)
            win_end = take(ends) & ok
        return Candidates(logprobs=win_val, tokens=win_tok, ends=win_end, next=win_next, parent=parent)


jax.tree_util.register_dataclass(
    TrieConstraint, data_fields=["parts", "set_ids"],
    meta_fields=["vocab_size", "num_sets", "max_len", "has_prefix_items", "eos_ids", "impl", "mesh"],
    drop_fields=["host"])


def _pad_cands(c: Candidates, width: int) -> Candidates:
    """Pad the candidate axis to a common width (lax.switch branches must agree on shapes)."""
    return c.pad_to(width)


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
                    token_used, set_has_items, set_ids=None, impl: str = "auto", mesh=None) -> TrieConstraint:
    """A TrieConstraint over device parts. token_used (bool[V]) and set_has_items (bool[num_sets]) are host
    arrays: prepare() checks EOS ids and set ids against them without touching the device."""
    sets_host = None
    if set_ids is not None:
        if np.ndim(set_ids) != 1:
            raise ConstraintError(f"set_ids must be a 1-D list of item-set ids (one per batch row), got "
                                  f"shape {np.shape(set_ids)}")
        sets_host = host_set_ids(set_ids)
        set_ids = jnp.asarray(set_ids, jnp.int32)
    resolve_impl(impl)
    host = HostFacts(token_used=np.asarray(token_used, bool), set_has_items=np.asarray(set_has_items, bool),
                     set_ids_src=set_ids, set_ids=sets_host)
    return TrieConstraint(parts=tuple(parts), set_ids=set_ids, vocab_size=int(vocab_size), num_sets=int(num_sets),
                          max_len=int(max_len), has_prefix_items=bool(has_prefix_items), impl=impl, mesh=mesh,
                          host=host)


def sets_with_items(index, alive=None) -> np.ndarray:
    """bool[num_sets] (host): the index holds an item of the set (with `alive`, a packed bitmap of live
    states, a live one). The set roots are the children of state 0, and their tokens are the set ids."""
    toks, roots = index.children(0)
    out = np.zeros(index.num_sets, bool)
    keep = np.ones(toks.shape, bool) if alive is None else get_bits(alive, roots)
    out[toks[keep]] = True
    return out


def constraint_from_index(index, *, set_ids=None, impl: str = "auto", mesh=None) -> TrieConstraint:
    """The TrieConstraint of a TrieIndex (uploads its arrays)."""
    return make_constraint([part_from_index(index)], vocab_size=index.vocab_size, num_sets=index.num_sets,
                           max_len=index.max_len, has_prefix_items=index.has_prefix_items,
                           token_used=index.token_used, set_has_items=sets_with_items(index), set_ids=set_ids,
                           impl=impl, mesh=mesh)


__all__ = ["Candidates", "ConstraintError", "HostFacts", "TrieConstraint", "TriePart", "TrieState",
           "constraint_from_index", "make_constraint", "part_from_index", "sets_with_items"]
