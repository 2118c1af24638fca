"""Adding and removing items without rebuilding the index.

    dyn = DynamicIndex(build_index(items, V))
    dyn.add([[5, 1, 2]]); dyn.remove([[3, 3, 3]])
    c = dyn.constraint()          # a two-part TrieConstraint: base (with removals) + delta (additions)
    dyn.compact()                 # fold everything into a fresh base when the delta has grown

Design (the choice the issue leaves open):
  * Removals are a mask on the base trie. Every base state keeps, on the host, the number of live items
    below it (int32[S]). Removing an item clears its final bit and decrements the counts along its
    path; a state whose count reaches 0 is dead: its bit in `alive_bits` is cleared and so is its
    entry in a dense table. Decoding skips dead states, so a prefix whose every item was removed is
    never offered (no beam walks into a dead end).
  * Additions go to a small delta trie (a normal TrieIndex over the added items), rebuilt on every
    add. An added item that is a removed base item is revived in place instead.
  * The decoder walks both tries at once: a row's state is (base state, delta state); each step offers
    the union of the two rows, a token both offer appears once with both next states (binary search
    in the other trie's row). See jaxdecode.constraints.trie.

Complexity (N base items, D delta items, L item length, K row width, S base states):
  add k items:    O(k L log K) host walks + O((D + k) L log(D + k)) delta rebuild; uploads the delta
                  (D-sized) at the next constraint()
  remove k items: O(k L log K) host walks and count updates; the next constraint() uploads the final
                  and alive bitmaps (2 S / 8 bytes) and the dense tables (changed ones only matter)
  decoding:       one extra CSR row (width <= the delta's K) and O(K log K) binary searches per row
                  and step while the delta is non-empty; nothing extra for removals beyond a bit test
  compact():      a full rebuild, O((N + D) L log(N + D)); call it when D grows past a few percent
The base CSR arrays are uploaded once and reused by every constraint() until compact().
`has_prefix_items` and `max_len` stay conservative between compactions (a removed long or prefix item
still counts), which can only ask for EOS ids or a larger max_new_tokens, never drop an item.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxdecode.constraints.index import ItemSetError, TrieIndex, build_index, get_bits, normalise_items, set_bits


class DynamicIndex:
    """A TrieIndex plus removals (a live mask) and additions (a delta trie). See the module docstring."""

    def __init__(self, base: TrieIndex):
        if not isinstance(base, TrieIndex):
            raise TypeError(f"DynamicIndex wraps a TrieIndex, got {type(base).__name__}")
        self._reset(base)

    def _reset(self, base: TrieIndex):
        self.base = base
        s = base.num_states
        self._final = base.final_bits.copy()
        final = np.unpackbits(base.final_bits, bitorder="little")[:s].astype(np.int64)
        count = final.copy()
        starts = base.level_start
        for lv in range(base.num_levels - 1, 0, -1):  # children add their live items to their parents
            lo, hi = starts[lv], starts[lv + 1]
            if hi == lo:
                continue
            per_parent = np.diff(base.indptr[starts[lv - 1]: starts[lv] + 1])
            parents = np.repeat(np.arange(starts[lv - 1], starts[lv]), per_parent)
            count[starts[lv - 1]:starts[lv]] += np.bincount(parents - starts[lv - 1], weights=count[lo:hi],
                                                            minlength=starts[lv] - starts[lv - 1]).astype(np.int64)
        self._count = count.astype(np.int32)
        self._alive = np.packbits(self._count > 0, bitorder="little")
        self._dense = {lv: t.copy() for lv, t in base.dense.items()}
        self._delta_items: dict[tuple, None] = {}  # (set id, tokens) in insertion order
        self._delta: TrieIndex | None = None
        self._removed = 0
        self._cross_prefix = False
        self._device_base = None  # (edge_token, indptr) on the device, uploaded once per base

    # ------------------------------------------------------------------ sizes
    @property
    def num_items(self) -> int:
        return self.base.num_items - self._removed + len(self._delta_items)

    @property
    def num_added(self) -> int:
        return len(self._delta_items)

    @property
    def num_removed(self) -> int:
        return self._removed

    @property
    def has_prefix_items(self) -> bool:
        return bool(self.base.has_prefix_items or self._cross_prefix
                    or (self._delta is not None and self._delta.has_prefix_items))

    @property
    def max_len(self) -> int:
        return max(self.base.max_len, 0 if self._delta is None else self._delta.max_len)

    # ------------------------------------------------------------------ host helpers
    def _keys(self, items, set_ids) -> list[tuple[int, tuple]]:
        tokens, lens = normalise_items(items)
        n = lens.size
        if n == 0:
            return []
        if (lens == 0).any():
            raise ItemSetError(f"item {int(np.flatnonzero(lens == 0)[0])} is empty")
        v = self.base.vocab_size
        bad = np.flatnonzero((tokens < 0) | (tokens >= v))
        if bad.size:
            raise ItemSetError(f"token id {int(tokens[bad[0]])} is outside the vocabulary [0, {v})")
        sets = np.zeros(n, np.int64) if set_ids is None else np.asarray(set_ids)
        if sets.shape != (n,) or not np.issubdtype(sets.dtype, np.integer):
            raise ItemSetError(f"set_ids must be an int array of shape ({n},), got {sets.dtype}{sets.shape}")
        bad = np.flatnonzero((sets < 0) | (sets >= self.base.num_sets))
        if bad.size:
            raise ItemSetError(f"set id {int(sets[bad[0]])} is outside [0, {self.base.num_sets}); the number of "
                               "sets is fixed until a rebuild (build_index(..., num_sets=...))")
        splits = np.split(tokens.astype(np.int64), np.cumsum(lens)[:-1])
        return [(int(s), tuple(int(t) for t in it)) for s, it in zip(sets, splits)]

    def _full_path(self, key) -> list[int] | None:
        """[global root, set root, states after each token] of an item present as a path in the base."""
        s, item = key
        path = self.base.walk(item, s)
        return [0] + path if len(path) == len(item) + 1 else None

    def _set_live(self, path: list[int], delta: int):
        """Add delta (+1 / -1) live items along a path; flip alive bits and dense entries that change."""
        idx = np.asarray(path, np.int64)
        before = self._count[idx] > 0
        self._count[idx] += delta
        after = self._count[idx] > 0
        changed = idx[before != after]
        set_bits(self._alive, changed, delta > 0)
        starts = np.asarray(self.base.level_start)
        for st in changed:  # at most one per level
            lv = int(np.searchsorted(starts, st, side="right") - 1)
            if lv - 1 in self._dense:
                parent = path[path.index(int(st)) - 1]
                token = int(self.base.edge_token[st - 1])
                self._dense[lv - 1][parent - starts[lv - 1], token] = delta > 0

    def _rebuild_delta(self):
        if not self._delta_items:
            self._delta = None
            return
        keys = list(self._delta_items)
        self._delta = build_index([list(k[1]) for k in keys], self.base.vocab_size,
                                  set_ids=np.array([k[0] for k in keys]), num_sets=self.base.num_sets,
                                  dense_levels=())

    # ------------------------------------------------------------------ updates
    def add(self, items, set_ids=None) -> dict:
        """Add items (same forms as build_index). Returns {"added", "revived", "already_present"}."""
        added = revived = present = 0
        for key in self._keys(items, set_ids):
            path = self._full_path(key)
            if path is not None and get_bits(self.base.final_bits, path[-1]):  # a base item
                if get_bits(self._final, path[-1]):
                    present += 1
                else:
                    set_bits(self._final, [path[-1]], True)
                    self._set_live(path, +1)
                    self._removed -= 1
                    revived += 1
                continue
            if key in self._delta_items:
                present += 1
                continue
            self._delta_items[key] = None
            added += 1
            # Prefix relations with live base items (the delta's own are in its has_prefix_items).
            walk = [0] + self.base.walk(key[1], key[0])
            prefixes = walk[2:len(key[1]) + 1]  # states after 1 .. len - 1 tokens
            if prefixes and get_bits(self._final, np.asarray(prefixes)).any():
                self._cross_prefix = True
            if path is not None and self._count[path[-1]] > 0:  # a live base item extends it
                self._cross_prefix = True
        if added:
            self._rebuild_delta()
        return dict(added=added, revived=revived, already_present=present)

    def remove(self, items, set_ids=None, *, missing_ok: bool = False) -> dict:
        """Remove items. An item in neither the base nor the delta is an ItemSetError unless
        missing_ok=True. Returns {"removed", "missing"}."""
        keys = self._keys(items, set_ids)
        missing = []
        for key in keys:  # check first, so a failing call changes nothing
            path = self._full_path(key)
            in_base = path is not None and get_bits(self._final, path[-1])
            if not in_base and key not in self._delta_items:
                missing.append(key)
        if missing and not missing_ok:
            s, item = missing[0]
            raise ItemSetError(f"item {list(item)} (set {s}) is not in the index ({len(missing)} of "
                               f"{len(keys)} items missing); pass missing_ok=True to skip them")
        removed, delta_changed = 0, False
        for key in keys:
            path = self._full_path(key)
            if path is not None and get_bits(self._final, path[-1]):
                set_bits(self._final, [path[-1]], False)
                self._set_live(path, -1)
                self._removed += 1
                removed += 1
            elif key in self._delta_items:
                del self._delta_items[key]
                delta_changed = True
                removed += 1
        if delta_changed:
            self._rebuild_delta()
        return dict(removed=removed, missing=len(missing))

    def contains(self, item: Sequence[int], set_id: int = 0) -> bool:
        key = (int(set_id), tuple(int(t) for t in item))
        path = self._full_path(key)
        return bool(path is not None and get_bits(self._final, path[-1])) or key in self._delta_items

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every live item: (tokens int64[T], lengths int64[N], set_ids int64[N])."""
        tokens, lens, sets = self.base.items(final_bits=self._final)
        if self._delta_items:
            keys = list(self._delta_items)
            tokens = np.concatenate([tokens, np.array([t for k in keys for t in k[1]], np.int64)])
            lens = np.concatenate([lens, np.array([len(k[1]) for k in keys], np.int64)])
            sets = np.concatenate([sets, np.array([k[0] for k in keys], np.int64)])
        return tokens, lens, sets

    def compact(self, **build_kw) -> TrieIndex:
        """Rebuild one base index from the live items (full rebuild); returns it and continues on it."""
        tokens, lens, sets = self.items()
        if lens.size == 0:
            raise ItemSetError("every item was removed; an index needs at least one item")
        width = int(lens.max())
        mat = np.zeros((lens.size, width), np.int64)
        mat[np.arange(width)[None, :] < lens[:, None]] = tokens
        base = build_index(mat, self.base.vocab_size, lengths=lens, set_ids=sets, num_sets=self.base.num_sets,
                           **build_kw)
        self._reset(base)
        return base

    # ------------------------------------------------------------------ decoding
    def constraint(self, *, set_ids=None, impl: str = "auto", mesh=None):
        """A TrieConstraint over the base (with removals) and the delta (additions)."""
        import jax.numpy as jnp

        from jaxdecode.constraints.trie import make_constraint, part_from_index, sets_with_items
        if self.num_items == 0:
            raise ItemSetError("every item was removed; nothing can be decoded")
        if self._device_base is None:
            self._device_base = (jnp.asarray(self.base.edge_token), jnp.asarray(self.base.indptr))
        b = self.base
        parts = [part_from_index(b, final_bits=self._final, alive_bits=self._alive, dense=self._dense,
                                 device_csr=self._device_base)]
        used = b.token_used.copy()
        sets = sets_with_items(b, alive=self._alive)
        if self._delta is not None:
            # Bucketed shapes: successive deltas reuse the compiled decoder.
            parts.append(part_from_index(self._delta, bucket_levels=b.num_levels))
            used |= self._delta.token_used
            sets |= sets_with_items(self._delta)
        return make_constraint(parts, vocab_size=b.vocab_size, num_sets=b.num_sets, max_len=self.max_len,
                               has_prefix_items=self.has_prefix_items, token_used=used, set_has_items=sets,
                               set_ids=set_ids, impl=impl, mesh=mesh)


__all__ = ["DynamicIndex"]
