"""The item index: allowed token sequences as a trie flattened into CSR arrays (STATIC, ALGORITHMS.md §6).

    index = build_index(items, vocab_size)            # array [N, L], list of token lists, or a file
    index = build_index(items, vocab_size, set_ids=s) # several item sets in one index (per-request sets)
    index.save(path); load_index(path)

Layout. The trie is over `(set id, t_1, ..., t_n)`: internal level 0 is one global root, level 1 holds
one root per item set, level 1 + d the nodes reached after d item tokens. States are numbered in
breadth-first order, level by level, and inside a level in lexicographic order of their prefixes.
Then the children of every state are consecutive states, in token order, and each state s > 0 has
exactly one incoming edge, number s - 1. So the CSR needs no `next_state` column at all:
    edge_token[e]   token of edge e, which leads to state e + 1            int16 (int32 past 32767)
    indptr[s]       the children of s are states indptr[s] + 1 .. indptr[s+1]   int32
    final_bits      bit s (little-endian bit order): an item ends at state s    uint8[ceil(S / 8)]
States of the deepest level have no children, so `indptr` stops before them (`n_inner` entries + 1).
An item may end at an inner state (it is a prefix of another item); that is what the final flag is
for. For 1e6 random items of length 8 over V = 2048 this is ~7e6 states: ~14 MB of tokens, ~24 MB of
indptr, <1 MB of final bits, plus 4 MB for the one dense level that pays -- ~42 MB, against ~95 MB for
the reference layout ([token, next_state] int32 pairs, int32 indptr and two V x V tables).

Dense levels. A level whose widest row is at least V / DENSE_WIDTH_RATIO tokens wide also gets a
bool[n_states, V] table (a contiguous row read and a masked top-k over V instead of a wide scattered
gather), while the tables stay within `dense_budget` bytes (default: the larger of 8 MiB and 10% of the
CSR bytes). The CSR rows of those levels stay too: lookups of a chosen token's next state use them.

Building sorts and de-duplicates (the input order does not matter; the number of duplicates is
reported), accepts variable lengths (prefix items included) and checks every id. Everything is
vectorised NumPy: one lexicographic sort over bit-packed rows, then one pass per level.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from pathlib import Path
from typing import Sequence

import numpy as np

DENSE_WIDTH_RATIO = 8  # a level is dense when its widest row holds >= V / 8 tokens
DENSE_MIN_BUDGET = 8 << 20  # bytes of dense tables always allowed
MAX_ITEM_LEN = 4096
_INT32_MAX = np.iinfo(np.int32).max
FORMAT_VERSION = 1


class ItemSetError(ValueError):
    """An item set (or a file of items) that cannot be indexed as given."""


# ----------------------------------------------------------------------------- bit helpers
def get_bits(bits: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """bool[...]: bit idx of a little-endian packed uint8 array (host)."""
    idx = np.asarray(idx, np.int64)
    return ((bits[idx >> 3] >> (idx & 7).astype(np.uint8)) & 1).astype(bool)


def set_bits(bits: np.ndarray, idx, value: bool) -> None:
    """In place: bit idx of a packed uint8 array := value (host)."""
    idx = np.asarray(idx, np.int64)
    if idx.size == 0:
        return
    byte, mask = idx >> 3, (np.uint8(1) << (idx & 7).astype(np.uint8)).astype(np.uint8)
    if value:
        np.bitwise_or.at(bits, byte, mask)
    else:
        np.bitwise_and.at(bits, byte, ~mask)


# ----------------------------------------------------------------------------- input normalisation
def _check_int(name, value, minimum=1) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ItemSetError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def read_items_file(path) -> tuple[np.ndarray, np.ndarray]:
    """Parse a file with one item per line, token ids separated by spaces (or tabs).

    Returns (tokens int64[T] concatenated, lengths int64[N]). Blank lines, signs other than a leading
    '-' and anything that is not an integer are errors naming the line (nothing is skipped).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"item file {path} does not exist")
    raw = path.read_bytes()
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    if not raw.strip():
        raise ItemSetError(f"{path} holds no items (an empty item set cannot be indexed)")
    buf = np.frombuffer(raw.replace(b"\r\n", b"\n"), np.uint8)
    is_digit = (buf >= ord("0")) & (buf <= ord("9"))
    is_space = (buf == ord(" ")) | (buf == ord("\t"))
    is_nl = buf == ord("\n")
    is_minus = buf == ord("-")
    line_of = np.concatenate([[0], np.cumsum(is_nl)[:-1]])  # line number (0-based) of each byte
    bad = ~(is_digit | is_space | is_nl | is_minus)
    prev = np.concatenate([[ord(" ")], buf[:-1]])
    nxt = np.concatenate([buf[1:], [ord(" ")]])
    # A '-' must start a number: preceded by a separator, followed by a digit.
    bad |= is_minus & ~(((prev == ord(" ")) | (prev == ord("\t")) | (prev == ord("\n")))
                        & (nxt >= ord("0")) & (nxt <= ord("9")))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        line = raw.split(b"\n")[int(line_of[i])].decode(errors="replace")
        raise ItemSetError(f"{path}, line {int(line_of[i]) + 1}: {line[:80]!r} is not a list of integer "
                           "token ids separated by spaces")
    starts = (is_digit | is_minus) & ~(np.concatenate([[False], is_digit[:-1] | is_minus[:-1]]))
    n_lines = int(is_nl.sum()) + 1
    lengths = np.bincount(line_of[starts], minlength=n_lines).astype(np.int64)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ItemSetError(f"{path}, line {int(empty[0]) + 1} is empty; every line must hold one item "
                           "(token ids separated by spaces)")
    # C-speed text parse; the byte scan above already proved the text is integers and separators.
    tokens = np.fromstring(raw.replace(b"\t", b" ").replace(b"\n", b" ").decode(), dtype=np.int64, sep=" ")
    if tokens.size != int(lengths.sum()):
        raise ItemSetError(f"{path}: parsed {tokens.size} token ids but counted {int(lengths.sum())}; "
                           "the file must hold only integers, spaces and newlines")
    info = np.iinfo(np.int64)
    saturated = np.flatnonzero((tokens == info.max) | (tokens == info.min))
    if saturated.size:  # the parse saturates ids past int64: report the id as the file writes it
        words = raw.split()
        item_of = np.repeat(np.arange(n_lines), lengths)
        for k in saturated:
            word = words[int(k)].decode()
            if int(word) != int(tokens[k]):
                item = int(item_of[k])
                raise ItemSetError(f"{path}, line {item + 1}: item {item} holds token id {word}, outside the "
                                   f"vocabulary (it does not fit in 64 bits); ids must be in 0..vocab_size-1")
    return tokens, lengths


def normalise_items(items, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """items (2-D int array, optionally with per-row `lengths`; a list of token lists; or a file path)
    -> (tokens int64[T] concatenated, lengths int64[N])."""
    if isinstance(items, (str, os.PathLike)):
        if lengths is not None:
            raise ItemSetError("lengths= is for 2-D arrays, not for item files")
        return read_items_file(items)
    if isinstance(items, np.ndarray) or hasattr(items, "__array__") and not isinstance(items, (list, tuple)):
        arr = np.asarray(items)
        if arr.ndim != 2:
            raise ItemSetError(f"an item array must be 2-D [items, length], got shape {arr.shape}; pass "
                               "variable-length items as a list of token lists")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ItemSetError(f"item token ids must be integers, got dtype {arr.dtype}")
        n, width = arr.shape
        if lengths is None:
            return arr.reshape(-1), np.full(n, width, np.int64)
        lengths = np.asarray(lengths)
        if lengths.shape != (n,) or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
            raise ItemSetError(f"lengths must be an int array of shape ({n},), got {lengths.dtype}{lengths.shape}")
        if lengths.size and (lengths.min() < 0 or lengths.max() > width):
            i = int(np.flatnonzero((lengths < 0) | (lengths > width))[0])
            raise ItemSetError(f"lengths[{i}] = {int(lengths[i])} is outside [0, {width}] (the array width)")
        keep = np.arange(width)[None, :] < lengths[:, None]
        return arr[keep], lengths.astype(np.int64)
    if not isinstance(items, Sequence) or isinstance(items, (bytes, str)):
        raise ItemSetError(f"items must be a 2-D int array, a list of token lists or a file path, got "
                           f"{type(items).__name__}")
    if lengths is not None:
        raise ItemSetError("lengths= is for 2-D arrays; a list of token lists carries its own lengths")
    rows = []
    for i, it in enumerate(items):
        r = np.asarray(it)
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise ItemSetError(f"item {i} must be a flat list of int token ids, got {it!r:.80}")
        rows.append(r.astype(np.int64))
    lens = np.array([r.size for r in rows], np.int64)
    return (np.concatenate(rows) if rows else np.zeros(0, np.int64)), lens


# ----------------------------------------------------------------------------- the index
@dataclasses.dataclass(frozen=True, eq=False)
class TrieIndex:
    """A built item index (host NumPy arrays + static metadata). See the module docstring."""
    vocab_size: int
    num_sets: int
    edge_token: np.ndarray  # int16|int32[S - 1]
    indptr: np.ndarray  # int32[n_inner + 1]
    final_bits: np.ndarray  # uint8[ceil(S / 8)]
    level_start: tuple  # first state of each internal level, plus S at the end
    level_width: tuple  # widest row (max children) of each internal level
    level_leaves: tuple  # states without children at each internal level
    dense: dict  # internal level -> bool[n_states of the level, V]
    num_items: int
    num_duplicates: int  # duplicates dropped while building (reported, not silently lost)
    max_len: int  # longest item (tokens)
    min_len: int
    has_prefix_items: bool  # some item is a proper prefix of another (needs EOS to end)
    token_used: np.ndarray  # bool[V]: the id occurs in some item

    # ------------------------------------------------------------------ sizes
    @property
    def num_states(self) -> int:
        return int(self.level_start[-1])

    @property
    def n_inner(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_levels(self) -> int:
        return len(self.level_start) - 1

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays a decoder needs on the device."""
        return int(self.edge_token.nbytes + self.indptr.nbytes + self.final_bits.nbytes
                   + sum(t.nbytes for t in self.dense.values()))

    def level_size(self, level: int) -> int:
        return int(self.level_start[level + 1] - self.level_start[level])

    def summary(self) -> dict:
        return dict(items=self.num_items, duplicates_dropped=self.num_duplicates, sets=self.num_sets,
                    vocab_size=self.vocab_size, states=self.num_states, min_len=self.min_len,
                    max_len=self.max_len, prefix_items=self.has_prefix_items,
                    item_level_widths=list(self.level_width[1:-1]),
                    dense_item_levels=sorted(lv - 1 for lv in self.dense),
                    bytes=self.nbytes, bytes_per_item=round(self.nbytes / self.num_items, 2))

    # ------------------------------------------------------------------ host queries
    def final(self, states) -> np.ndarray:
        return get_bits(self.final_bits, states)

    def children(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, child states) of one state, tokens ascending."""
        if state < 0 or state >= self.n_inner:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        lo, hi = int(self.indptr[state]), int(self.indptr[state + 1])
        return self.edge_token[lo:hi].astype(np.int64), np.arange(lo + 1, hi + 1)

    def child(self, state: int, token: int) -> int:
        """The child of `state` along `token`, or -1 (binary search in the CSR row)."""
        if state < 0 or state >= self.n_inner:
            return -1
        lo, hi = int(self.indptr[state]), int(self.indptr[state + 1])
        j = lo + int(np.searchsorted(self.edge_token[lo:hi], token))
        return j + 1 if j < hi and int(self.edge_token[j]) == token else -1

    def walk(self, item: Sequence[int], set_id: int = 0) -> list[int]:
        """States along (set_id, *item): [set root, after t_1, ...]; stops early (shorter) on a miss."""
        path = []
        s = self.child(0, int(set_id))
        for t in [None, *item]:
            if t is not None:
                s = self.child(s, int(t))
            if s < 0:
                break
            path.append(s)
        return path

    def contains(self, item: Sequence[int], set_id: int = 0) -> bool:
        path = self.walk(item, set_id)
        return len(path) == len(item) + 1 and bool(self.final(path[-1]))

    def parents(self, states: np.ndarray) -> np.ndarray:
        """Parent state of each state > 0 (vectorised: the CSR row that holds edge s - 1)."""
        return np.searchsorted(self.indptr, np.asarray(states, np.int64) - 1, side="right") - 1

    def items(self, final_bits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every item back from the trie, in breadth-first order of their final states: (tokens int64[T],
        lengths int64[N], set_ids int64[N]). `final_bits` overrides which states end an item (used by
        DynamicIndex.compact)."""
        bits = self.final_bits if final_bits is None else final_bits
        finals = np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.num_states])
        level = np.searchsorted(np.asarray(self.level_start), finals, side="right") - 1
        lengths = level - 1  # internal level 1 + d = after d item tokens
        width = int(lengths.max()) if lengths.size else 0
        mat = np.zeros((finals.size, width), np.int64)
        cur = finals.copy()
        for d in range(width, 0, -1):  # climb from the deepest token position
            on = lengths >= d
            mat[on, d - 1] = self.edge_token[cur[on] - 1]
            cur[on] = self.parents(cur[on])
        set_ids = self.edge_token[cur - 1].astype(np.int64)  # cur is now the set root
        keep = np.arange(width)[None, :] < lengths[:, None]
        return mat[keep], lengths.astype(np.int64), set_ids

    # ------------------------------------------------------------------ decoding
    def constraint(self, *, set_ids=None, impl: str = "auto", mesh=None):
        """The device-side TrieConstraint (jaxdecode.constraints.trie): set_ids picks each batch row's
        item set; impl the constrained_topk implementation; mesh runs the step under shard_map."""
        from jaxdecode.constraints.trie import constraint_from_index
        return constraint_from_index(self, set_ids=set_ids, impl=impl, mesh=mesh)

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> Path:
        """Write the index to one .npz file (uncompressed: loads without a decode pass)."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_suffix(path.suffix + ".npz") if path.suffix else path.with_suffix(".npz")
        meta = dict(format=FORMAT_VERSION, vocab_size=self.vocab_size, num_sets=self.num_sets,
                    level_start=list(self.level_start), level_width=list(self.level_width),
                    level_leaves=list(self.level_leaves), num_items=self.num_items,
                    num_duplicates=self.num_duplicates, max_len=self.max_len, min_len=self.min_len,
                    has_prefix_items=self.has_prefix_items, dense_levels=sorted(self.dense))
        arrays = dict(edge_token=self.edge_token, indptr=self.indptr, final_bits=self.final_bits,
                      token_used=np.packbits(self.token_used, bitorder="little"),
                      meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
        arrays.update({f"dense_{lv}": np.packbits(t, axis=-1, bitorder="little") for lv, t in self.dense.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return path


def load_index(path) -> TrieIndex:
    """Read an index written by `TrieIndex.save`. A file that is not one (another .npz, a truncated or
    corrupt file) is an ItemSetError that names it; nothing in it is ever unpickled."""
    path = Path(path)
    if not path.exists() and path.with_suffix(".npz").exists():
        path = path.with_suffix(".npz")
    if not path.exists():
        raise FileNotFoundError(f"index file {path} does not exist")
    try:
        return _read_index(path)
    except ItemSetError:
        raise
    except Exception as e:  # zip / npy / JSON / key errors: all mean "not a readable index"
        # (NumPy's own message for an object array would suggest allow_pickle: never do that here.)
        raise ItemSetError(f"{path} is not a valid jaxdecode item index (written by TrieIndex.save / "
                           f"`jaxdecode index build`): it is truncated, corrupt or another kind of file "
                           f"({type(e).__name__}); rebuild it") from None


def _read_index(path: Path) -> TrieIndex:
    not_index = f"{path} is not a valid jaxdecode item index"
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # every .npz is a zip archive
            raise ItemSetError(f"{not_index} (not an .npz archive); build one with `jaxdecode index build`")
    with np.load(path, allow_pickle=False) as z:
        if "meta" not in z.files:
            raise ItemSetError(f"{not_index} (no metadata); build one with `jaxdecode index build`")
        meta = json.loads(bytes(z["meta"]).decode())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise ItemSetError(f"{path} has index format {got}, this jaxdecode reads format "
                               f"{FORMAT_VERSION}; rebuild the index")
        missing = [n for n in ("edge_token", "indptr", "final_bits", "token_used") if n not in z.files]
        if missing:
            raise ItemSetError(f"{not_index} (no {missing[0]} array); rebuild it")
        v = int(meta["vocab_size"])
        dense = {}
        for lv in meta["dense_levels"]:
            packed = z[f"dense_{lv}"]
            dense[int(lv)] = np.unpackbits(packed, axis=-1, count=v, bitorder="little").astype(bool)
        return TrieIndex(
            vocab_size=v, num_sets=int(meta["num_sets"]), edge_token=z["edge_token"], indptr=z["indptr"],
            final_bits=z["final_bits"], level_start=tuple(meta["level_start"]),
            level_width=tuple(meta["level_width"]), level_leaves=tuple(meta["level_leaves"]), dense=dense,
            num_items=int(meta["num_items"]), num_duplicates=int(meta["num_duplicates"]),
            max_len=int(meta["max_len"]), min_len=int(meta["min_len"]),
            has_prefix_items=bool(meta["has_prefix_items"]),
            token_used=np.unpackbits(z["token_used"], count=v, bitorder="little").astype(bool))


# ----------------------------------------------------------------------------- building
def _sorted_unique_rows(mat: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """Rows of mat (non-negative, < 2**bits) in lexicographic order without duplicates.

    Rows are bit-packed into as few uint64 words as hold them (first column most significant), so the
    sort compares one or two machine words instead of every column."""
    n, c = mat.shape
    per_word = 64 // bits
    words = []
    for w0 in range(0, c, per_word):
        cols = mat[:, w0:w0 + per_word].astype(np.uint64)
        word = np.zeros(n, np.uint64)
        for j in range(cols.shape[1]):
            word = (word << np.uint64(bits)) | cols[:, j]
        words.append(word)
    if len(words) == 1:
        order = np.argsort(words[0], kind="stable")
    else:
        order = np.lexsort(words[::-1])  # lexsort's last key is the primary one
    sorted_words = [w[order] for w in words]
    dup = np.zeros(n, bool)
    if n > 1:
        same = np.ones(n - 1, bool)
        for w in sorted_words:
            same &= w[1:] == w[:-1]
        dup[1:] = same
    keep = order[~dup]
    return mat[keep], int(dup.sum())


def build_index(items, vocab_size: int, *, set_ids=None, num_sets: int | None = None, lengths=None,
                dense_levels: Sequence[int] | None = None, dense_budget: int | None = None) -> TrieIndex:
    """Build the trie index of `items` (see the module docstring).

    items: 2-D int array [N, L] (fixed length; with `lengths` [N] only the first lengths[i] ids of row
    i), a list of token-id lists (variable length), or a path to a file with one item per line.
    set_ids: int[N] set of each item (default 0); num_sets defaults to max(set_ids) + 1.
    dense_levels: item depths (0 = the first token) to give dense tables; None chooses by the rule in
    the module docstring; () disables them. Raises ItemSetError on an empty set, an empty item, an id
    outside [0, vocab_size), or sizes past the int32 state numbering.
    """
    vocab_size = _check_int("vocab_size", vocab_size)
    tokens, lens = normalise_items(items, lengths)
    n = lens.size
    if n == 0:
        raise ItemSetError("the item set is empty; an index needs at least one item")
    if (lens == 0).any():
        i = int(np.flatnonzero(lens == 0)[0])
        raise ItemSetError(f"item {i} is empty; every item needs at least one token")
    if int(lens.max()) > MAX_ITEM_LEN:
        i = int(np.argmax(lens))
        raise ItemSetError(f"item {i} has {int(lens[i])} tokens, more than MAX_ITEM_LEN={MAX_ITEM_LEN}")
    if tokens.size:
        bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
        if bad.size:
            pos = int(bad[0])
            item = int(np.searchsorted(np.cumsum(lens), pos, side="right"))
            raise ItemSetError(f"item {item} holds token id {int(tokens[pos])}, outside the vocabulary "
                               f"[0, {vocab_size}); ids must be in 0..{vocab_size - 1}")
    if set_ids is None:
        sets = np.zeros(n, np.int64)
    else:
        sets = np.asarray(set_ids)
        if sets.shape != (n,) or (sets.size and not np.issubdtype(sets.dtype, np.integer)):
            raise ItemSetError(f"set_ids must be an int array of shape ({n},) (one set per item), got "
                               f"{sets.dtype}{sets.shape}")
        sets = sets.astype(np.int64)
        if sets.min() < 0:
            raise ItemSetError(f"set id {int(sets.min())} is negative; set ids must be >= 0")
    max_set = int(sets.max())
    if num_sets is None:
        num_sets = max_set + 1
    num_sets = _check_int("num_sets", num_sets)
    if max_set >= num_sets:
        raise ItemSetError(f"set id {max_set} is outside [0, num_sets={num_sets})")
    total_states_bound = int(lens.sum()) + n + 1
    if total_states_bound > _INT32_MAX:
        raise ItemSetError(f"{int(lens.sum())} item tokens may need more trie states than int32 state ids "
                           f"hold ({_INT32_MAX}); split the set into several indexes")

    # Rows (set id, t_1 .. t_n) shifted by +1, so the padding 0 sorts before every token and a prefix
    # item comes right before its extensions.
    width = int(lens.max())
    top = max(vocab_size, num_sets)
    bits = int(top).bit_length()
    mat = np.zeros((n, width + 1), np.uint16 if top < (1 << 16) else np.uint32)
    mat[:, 0] = sets + 1
    if (lens == width).all():
        mat[:, 1:] = tokens.reshape(n, width).astype(mat.dtype) + 1
    else:  # row-major boolean assignment fills each row's first lens[i] columns in order
        mat[:, 1:][np.arange(width)[None, :] < lens[:, None]] = tokens.astype(mat.dtype) + 1
    token_used = np.bincount(tokens.reshape(-1), minlength=vocab_size) > 0
    mat, n_dup = _sorted_unique_rows(mat, bits)
    n = mat.shape[0]
    ilen = (mat[:, 1:] > 0).sum(axis=1) + 1  # internal length: set column + tokens

    # first_diff[i]: first column where sorted row i differs from row i - 1 (0 for the first row).
    first_diff = np.full(n, width + 1, np.int32)
    first_diff[0] = 0
    for c in range(width, -1, -1):
        first_diff[1:][mat[1:, c] != mat[:-1, c]] = c

    n_levels = width + 2  # root, set roots, one per token position
    level_start = [0, 1]
    edge_tokens, child_counts, finals = [], [np.zeros(1, np.int64)], []
    prev_ids = np.zeros(n, np.int64)  # state of each row at the previous level (root for level 0)
    for lv in range(1, n_levels):
        col = lv - 1
        has = ilen >= lv
        new = has & (first_diff <= col)
        ids = level_start[lv] + np.cumsum(new) - 1  # same-prefix rows share the last new row's state
        parents = prev_ids[new]
        edge_tokens.append(mat[new, col].astype(np.int64) - 1)
        n_prev = level_start[lv] - level_start[lv - 1]
        child_counts[-1] = np.bincount(parents - level_start[lv - 1], minlength=n_prev)
        n_new = int(new.sum())
        level_start.append(level_start[lv] + n_new)
        child_counts.append(np.zeros(n_new, np.int64))
        finals.append(ids[ilen == lv])
        prev_ids = np.where(has, ids, 0)
    num_states = level_start[-1]
    counts = np.concatenate(child_counts)
    n_inner = level_start[n_levels - 1]  # the deepest level has no children
    indptr = np.zeros(n_inner + 1, np.int64)
    np.cumsum(counts[:n_inner], out=indptr[1:])
    if indptr[-1] != num_states - 1:
        raise AssertionError("trie edge count mismatch")  # internal invariant, not an input error
    edge_token = np.concatenate(edge_tokens)
    edge_token = edge_token.astype(np.int16 if top <= np.iinfo(np.int16).max else np.int32)
    final = np.zeros(num_states, bool)
    final[np.concatenate(finals)] = True
    level_width, level_leaves = [], []
    for lv in range(n_levels):
        c = counts[level_start[lv]:level_start[lv + 1]]
        level_width.append(int(c.max()) if c.size else 0)
        level_leaves.append(int((c == 0).sum()))
    has_prefix = bool((final[:n_inner] & (counts[:n_inner] > 0)).any())

    index_wo_dense = dict(vocab_size=vocab_size, num_sets=num_sets, edge_token=edge_token,
                          indptr=indptr.astype(np.int32), final_bits=np.packbits(final, bitorder="little"),
                          level_start=tuple(int(x) for x in level_start),
                          level_width=tuple(level_width), level_leaves=tuple(level_leaves),
                          num_items=n, num_duplicates=n_dup, max_len=width, min_len=int(ilen.min()) - 1,
                          has_prefix_items=has_prefix, token_used=token_used)
    csr_bytes = edge_token.nbytes + 4 * (n_inner + 1) + (num_states + 7) // 8
    dense = _choose_dense(index_wo_dense, counts, dense_levels, dense_budget, csr_bytes)
    return TrieIndex(dense=dense, **index_wo_dense)


def _choose_dense(ix: dict, counts, dense_levels, dense_budget, csr_bytes) -> dict:
    """The dense tables: chosen item depths, or the widest-first levels that pay, within the budget."""
    v = ix["vocab_size"]
    starts, widths = ix["level_start"], ix["level_width"]
    n_levels = len(starts) - 1
    item_levels = range(1, n_levels - 1)  # internal levels with children that a decoder expands
    if dense_levels is None:
        budget = max(DENSE_MIN_BUDGET, csr_bytes // 10) if dense_budget is None else int(dense_budget)
        wanted = [lv for lv in item_levels if widths[lv] * DENSE_WIDTH_RATIO >= v]
        chosen, used = [], 0
        for lv in sorted(wanted, key=lambda lv: starts[lv + 1] - starts[lv]):  # cheapest tables first
            size = (starts[lv + 1] - starts[lv]) * v
            if used + size <= budget:
                chosen.append(lv)
                used += size
    else:
        chosen = []
        for d in dense_levels:
            d = _check_int("dense level", d, 0)
            if d + 1 not in item_levels:
                raise ItemSetError(f"dense level {d} is not an item depth with children (0..{n_levels - 3})")
            chosen.append(d + 1)
    edge_token, starts_arr = ix["edge_token"], np.asarray(starts)
    dense = {}
    for lv in sorted(set(chosen)):
        n_lv = starts[lv + 1] - starts[lv]
        table = np.zeros((n_lv, v), bool)
        # Edges out of level lv lead to states of level lv + 1: edge e -> state e + 1.
        child = np.arange(starts_arr[lv + 1], starts_arr[lv + 2])
        parent = np.repeat(np.arange(n_lv), counts[starts[lv]:starts[lv + 1]])
        table[parent, edge_token[child - 1].astype(np.int64)] = True
        dense[lv] = table
    return dense


__all__ = ["TrieIndex", "ItemSetError", "build_index", "load_index", "read_items_file", "normalise_items",
           "get_bits", "set_bits", "DENSE_WIDTH_RATIO", "MAX_ITEM_LEN"]
