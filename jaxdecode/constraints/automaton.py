"""Regex / JSON-schema constraints as token automata on the device (ALGORITHMS.md §6).

    auto = compile_regex(r"[0-9]{1,3}", tokenizer)            # host: outlines-core builds the token index
    auto = compile_json_schema(schema, tokenizer)             # JSON schema -> regex (outlines-core) -> index
    c = auto.constraint()                                     # AutomatonConstraint: the Constraint protocol
    out = decode(config, params, prompts, lengths, ..., constraint=c)

Compile on the host, run on the device. outlines-core (a well-kept Rust library) turns the regex into a
token-level DFA over the tokenizer's byte strings; here it is flattened into three arrays:

    token_class int32[V]     tokens whose columns are identical in the transition table share a class
    next        int32[S, C]  next[s, c]: the state after a token of class c in state s; -1 = forbidden
    final       bool[S]      accepting states: the EOS ids are allowed exactly there

A decode step is a gather, `next[s, token_class[t]]`, and the mask of allowed tokens is
`next[s][token_class] >= 0` (plus the EOS ids where final[s]): no host round trip per token, so
greedy, sampling, beam search and the constrained top-k kernel take it as they take the trie. Class 0
is the all-forbidden class (special tokens, ids past the tokenizer, ids outlines-core never allows).
Where its table fits a memory budget, `allowed` reads a packed bitmask row per state instead
(`TokenAutomaton.bits`, uint32[S, ceil(V / 32)]; see `TokenAutomaton.mask_form`); `next` stays for
advancing.

Only live states are kept: a state from which no accepting state can be reached (over tokens the
vocabulary has) is dropped with every transition into it, so a row can never walk into a dead end; a
pattern whose initial state is dead (the empty language over this tokenizer) is an AutomatonError.

Several patterns in one batch: `stack_automata([a, b, ...])` puts them in one table (states offset,
one initial state per pattern, joint token classes), and `auto.constraint(starts=[0, 1, 0])` says which
pattern each row follows; `per_row_constraint([regex, schema, ...], tokenizer)` does both.

JSON schema. outlines-core's converter silently ignores keywords it cannot express (numeric bounds,
uniqueItems, patternProperties, ...) and unrolls recursive $refs to a fixed depth; `check_schema` walks
the schema first and raises for each of those, naming the keyword and its JSON path (see
UNSUPPORTED_KEYWORDS), so an automaton never admits a text the schema rejects because a keyword was
dropped. Recursive schemas belong to the grammar path.

Token bytes. The automaton is over bytes: each id's byte string comes from the tokenizer (byte-level
BPE's printable-unicode alphabet mapped back to bytes, SentencePiece's '▁' and <0xNN> byte tokens), so
a token that spans the boundary of a literal (`":` in `{"a":1}`) or holds part of a UTF-8 character is
allowed exactly where its bytes fit the pattern.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.trie import Candidates, ConstraintError
from jaxdecode.kernels.constrained import constrained_topk

_NEG = float("-inf")
END_MARKER = "\U0010FFFF"  # appended to every regex before outlines-core compiles it (compile_regex)
CACHE_VERSION = 3


class AutomatonError(ConstraintError):
    """A pattern or schema that cannot be compiled into a token automaton, with what to change."""


# ----------------------------------------------------------------------------- token bytes
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode alphabet for bytes, inverted: char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _tokenizer_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return {}
    return json.loads(backend.to_str())


def _is_byte_level(spec: dict) -> bool:
    def has(node):
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(x) for x in node.get("pretokenizers", node.get("decoders", [])) or [])
    return has(spec.get("pre_tokenizer")) or has(spec.get("decoder"))


def special_token_ids(tokenizer) -> set[int]:
    ids = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(t, "special", False):
            ids.add(int(i))
    return ids


def token_bytes(tokenizer) -> list[bytes | None]:
    """The byte string of every token id (index = id), None for special tokens (never matched by a pattern).

    Byte-level BPE (GPT-2, Llama-3, Qwen): the vocabulary's printable alphabet maps back to bytes.
    SentencePiece (Llama-2, Mistral): '▁' is a space and <0xNN> is the byte NN. Otherwise the token's
    text encoded as UTF-8."""
    vocab = tokenizer.get_vocab()
    specials = special_token_ids(tokenizer)
    byte_level = _is_byte_level(_tokenizer_json(tokenizer))
    dec = _byte_level_decoder()
    out: list[bytes | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for text, i in vocab.items():
        if i in specials:
            continue
        if byte_level:
            try:
                out[i] = bytes(dec[ch] for ch in text)
            except KeyError:  # an added non-special token outside the byte alphabet: its text
                out[i] = text.encode("utf-8")
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out[i] = bytes([int(text[3:5], 16)])
        else:
            out[i] = text.replace("\u2581", " ").encode("utf-8")
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the id -> bytes map and the special ids: the cache key's tokenizer half."""
    h = hashlib.sha256()
    for i, b in enumerate(token_bytes(tokenizer)):
        h.update(i.to_bytes(4, "little") + (b"\xff\xff" if b is None else len(b).to_bytes(2, "little") + b))
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------- host automaton
_MASK_FORMS = ("auto", "bits", "classes")
MASK_BITS_BUDGET = 64 << 20  # bytes: the largest packed mask table `mask_form("auto")` puts on the device


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A token-level DFA in class form, on the host (NumPy). See the module docstring."""
    token_class: np.ndarray  # int32[V]
    next: np.ndarray  # int32[S, C]; -1 = forbidden; column 0 is all -1
    final: np.ndarray  # bool[S]
    initial: np.ndarray  # int32[N]: the start state of each pattern stacked here (one for one pattern)
    patterns: tuple = ()  # what each start state constrains to (the regex), for messages
    tokenizer: str = ""  # tokenizer_fingerprint of the tokenizer it was compiled for ("" unknown)

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next.shape[1])

    @property
    def num_patterns(self) -> int:
        return int(self.initial.shape[0])

    def step(self, state: int, token: int) -> int:
        """Host transition (-1: forbidden or dead)."""
        if state < 0 or not 0 <= token < self.vocab_size:
            return -1
        return int(self.next[state, self.token_class[token]])

    def walk(self, tokens, start: int = 0) -> int:
        """The state after `tokens` from pattern `start`'s initial state (-1 when a token is forbidden)."""
        s = int(self.initial[start])
        for t in tokens:
            s = self.step(s, int(t))
        return s

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state` (EOS not included)."""
        if state < 0:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.next[state][self.token_class] >= 0)

    # ------------------------------------------------------------------ packed mask form
    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    @functools.cached_property
    def bits(self) -> np.ndarray:
        """uint32[S, ceil(V / 32)]: bit t % 32 of word t // 32 of row s is set when token t is allowed in
        state s (EOS not included). Built in blocks of states, never as a dense [S, V] table."""
        s, w = self.num_states, self.mask_words
        out = np.zeros((s, w), np.uint32)
        shifts = np.arange(32, dtype=np.uint32)
        step = max(1, (1 << 22) // max(w * 32, 1))
        for lo in range(0, s, step):
            ok = self.next[lo:lo + step][:, self.token_class] >= 0  # [s_blk, V]
            ok = np.pad(ok, ((0, 0), (0, w * 32 - ok.shape[1]))).reshape(ok.shape[0], w, 32)
            out[lo:lo + step] = (ok.astype(np.uint32) << shifts).sum(axis=2, dtype=np.uint32)
        return out

    def mask_form(self, mask: str = "auto") -> str:
        """'bits' or 'classes': how `allowed` builds a row's mask. 'auto' takes the packed bitmask when its
        table (S * ceil(V / 32) uint32 words) fits MASK_BITS_BUDGET bytes, else the class path. A bitmask
        row is a shift and an and per token, the class path a gather per token; the gather cost ~10x
        more at batch 16 on CPU (notes: regex_bench_mask.py), so the bitmask is used whenever its device
        memory is affordable (S = 3000 states at V = 128k is 48 MiB)."""
        if mask not in _MASK_FORMS:
            raise ConstraintError(f"mask must be one of {_MASK_FORMS}, got {mask!r}")
        if mask != "auto":
            return mask
        return "bits" if 4 * _bucket(self.num_states) * self.mask_words <= MASK_BITS_BUDGET else "classes"

    def constraint(self, starts=None, *, impl: str = "auto", mask: str = "auto") -> "AutomatonConstraint":
        """The device constraint; `starts`: int[B], which stacked pattern each batch row follows (None:
        pattern 0 for every row); mask: 'auto' | 'bits' | 'classes' (see mask_form)."""
        starts_h = None if starts is None else np.asarray(starts).reshape(-1)
        if starts_h is not None and (starts_h.dtype.kind not in "iu" or starts_h.size == 0):
            raise ConstraintError(f"starts must be a non-empty list of pattern indices (ints), one per batch "
                                  f"row, got {starts!r}")
        if starts_h is not None and ((starts_h < 0) | (starts_h >= self.initial.shape[0])).any():
            bad = int(starts_h[(starts_h < 0) | (starts_h >= self.initial.shape[0])][0])
            raise ConstraintError(f"pattern index {bad} is outside [0, {self.initial.shape[0]}) (the patterns "
                                  "stacked in this automaton)")
        init = self.initial[np.zeros(1, np.int64) if starts_h is None else starts_h.astype(np.int64)]
        # Tables padded to power-of-two states / classes (padded states are dead and unreachable, padded
        # classes unused): patterns of similar size share one compiled decode instead of compiling each.
        (s, c), s_pad = self.next.shape, _bucket(self.num_states)
        nxt = np.full((s_pad, _bucket(c)), -1, np.int32)
        nxt[:s, :c] = self.next
        final = np.zeros(s_pad, bool)
        final[:s] = self.final
        bits = None
        if self.mask_form(mask) == "bits":
            bits = np.zeros((s_pad, self.mask_words), np.uint32)
            bits[:s] = self.bits
        return AutomatonConstraint(token_class=jnp.asarray(self.token_class), next=jnp.asarray(nxt),
                                   final=jnp.asarray(final), initial=jnp.asarray(init, jnp.int32),
                                   bits=None if bits is None else jnp.asarray(bits), per_row=starts_h is not None,
                                   impl=impl, host=self)

    # ------------------------------------------------------------------ save / load
    def save(self, path) -> None:
        np.savez_compressed(path, token_class=self.token_class, next=self.next, final=self.final,
                            initial=self.initial, patterns=np.array(self.patterns, dtype=np.str_),
                            tokenizer=np.array(self.tokenizer), version=np.int32(CACHE_VERSION))

    @classmethod
    def load(cls, path) -> "TokenAutomaton":
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"]) != CACHE_VERSION:
                raise AutomatonError(f"{path} was written by another automaton format version")
            auto = cls(token_class=z["token_class"], next=z["next"], final=z["final"], initial=z["initial"],
                       patterns=tuple(str(p) for p in z["patterns"]), tokenizer=str(z["tokenizer"]))
        _check_tables(auto, str(path))
        return auto


def _bucket(n: int) -> int:
    """A table dimension rounded up to a power of two (at least 8): the device shapes of automata."""
    from jaxdecode.kernels.common import next_pow2
    return next_pow2(max(int(n), 8))


def _check_tables(auto: TokenAutomaton, where: str) -> None:
    """Shapes and ranges of loaded tables (a damaged cache file must not index out of bounds)."""
    s, c = auto.next.shape if auto.next.ndim == 2 else (-1, -1)
    ok = (auto.next.ndim == 2 and auto.token_class.ndim == 1 and auto.final.shape == (s,)
          and auto.initial.ndim == 1 and auto.initial.size >= 1
          and auto.token_class.min(initial=0) >= 0 and auto.token_class.max(initial=0) < c
          and auto.next.min(initial=-1) >= -1 and auto.next.max(initial=-1) < s
          and auto.initial.min() >= 0 and auto.initial.max() < s)
    if not ok:
        raise AutomatonError(f"{where} does not hold a valid token automaton")


def _live_states(src, dst, num_states: int, initial, final) -> np.ndarray:
    """bool[S]: states reachable from an initial state that can reach an accepting one."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order

    def reach(a, b, seeds):  # states reachable from `seeds` over edges a -> b (a virtual root at S)
        n = num_states + 1
        rows = np.concatenate([a, np.full(len(seeds), num_states)])
        cols = np.concatenate([b, np.asarray(seeds, np.int64)])
        g = csr_matrix((np.ones(rows.size, np.int8), (rows, cols)), shape=(n, n))
        order = breadth_first_order(g, num_states, directed=True, return_predecessors=False)
        out = np.zeros(n, bool)
        out[order] = True
        return out[:num_states]

    return reach(src, dst, initial) & reach(dst, src, np.flatnonzero(final))


def from_transitions(transitions: dict, initial: int, finals, vocab_size: int, *, pattern: str = "",
                     drop_ids=(), tokenizer: str = "") -> TokenAutomaton:
    """Class form of a token DFA given as {state: {token: next state}} (outlines-core's
    `Index.get_transitions()`); `drop_ids` (the EOS ids) are left out of the table (EOS is allowed by
    `final`). Only live states are kept (reachable, and able to reach an accepting state), renumbered
    in sorted order; an automaton with no accepting path raises AutomatonError."""
    states = sorted(set(transitions) | {initial} | set(finals)
                    | {n for row in transitions.values() for n in row.values()})
    num = {s: i for i, s in enumerate(states)}
    drop = set(int(d) for d in drop_ids)
    rows, cols, vals = [], [], []
    for s, row in transitions.items():
        for t, n in row.items():
            if int(t) in drop or not 0 <= int(t) < vocab_size:
                continue
            rows.append(num[s])
            cols.append(int(t))
            vals.append(num[n])
    rows, cols, vals = (np.asarray(x, np.int64) for x in (rows, cols, vals))
    final = np.isin(np.arange(len(states)), [num[f] for f in finals])
    live = _live_states(rows, vals, len(states), [num[initial]], final)
    if not live[num[initial]]:
        raise AutomatonError(f"the pattern {pattern!r} has no accepting path over this tokenizer's tokens (no "
                             "text its tokens can spell matches it, or the only ways on need characters no "
                             "token holds); fix the pattern or the schema")
    keep = live[rows] & live[vals]
    new_id = np.cumsum(live) - 1
    src, tok, dst = new_id[rows[keep]], cols[keep], new_id[vals[keep]]
    token_class, nxt = _classes_from_edges(src, tok, dst, int(live.sum()), vocab_size)
    return TokenAutomaton(token_class=token_class, next=nxt, final=final[live],
                          initial=np.asarray([new_id[num[initial]]], np.int32), patterns=(pattern,),
                          tokenizer=tokenizer)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each uint64."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _classes_from_edges(src, tok, dst, num_states: int, vocab_size: int):
    """(token_class int32[V], next int32[S, C]) from the transition list (state src --tok--> dst), without
    the dense [S, V] table: a token's column is the set of its (src, dst) pairs, summarised by two
    64-bit sums of pair hashes; tokens with equal sums share a class, checked exactly afterwards (every
    token agrees with its class's table column and has as many transitions), with the dense way as the
    fallback. Class 0: tokens with no transition; the others numbered by their first token."""
    key = src.astype(np.uint64) * np.uint64(num_states + 1) + dst.astype(np.uint64)
    h = np.zeros((vocab_size, 2), np.uint64)
    with np.errstate(over="ignore"):
        np.add.at(h[:, 0], tok, _mix64(key))
        np.add.at(h[:, 1], tok, _mix64(key ^ np.uint64(0x5DEECE66D)))
    count = np.bincount(tok, minlength=vocab_size)
    sig = np.concatenate([h.view(np.int64), count[:, None].astype(np.int64)], axis=1)  # [V, 3]
    _, first, inv = np.unique(sig, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.argsort(first, kind="stable")  # classes by first token, then the empty one moved to 0
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    cls = rank[inv]
    empty = count == 0
    if empty.any():
        e = int(cls[np.flatnonzero(empty)[0]])
        cls = np.where(cls == e, 0, np.where(cls < e, cls + 1, cls))
    else:
        cls = cls + 1
    num_classes = int(cls.max()) + 1
    nxt = np.full((num_states, num_classes), -1, np.int32)
    nxt[src, cls[tok]] = dst
    ok = (nxt[src, cls[tok]] == dst).all()
    reps = np.zeros(num_classes, np.int64)
    reps[cls] = np.arange(vocab_size)
    ok = ok and (count == count[reps[cls]]).all() and (count[empty] == 0).all()
    if not ok:  # a hash collision (never seen): the exact dense way
        full = np.full((num_states, vocab_size), -1, np.int32)
        full[src, tok] = dst
        a = _classify(full, np.zeros(1, np.int32), np.zeros(num_states, bool), ())
        return a.token_class, a.next
    return cls.astype(np.int32), nxt


def _classify(full: np.ndarray, initial, final, patterns, tokenizer: str = "") -> TokenAutomaton:
    """Tokens with identical columns of full[S, V] share a class; the all-forbidden column is class 0."""
    forbidden = np.full((full.shape[0], 1), -1, np.int32)
    cols, token_class = np.unique(np.concatenate([forbidden, full], axis=1), axis=1, return_inverse=True)
    token_class = token_class.reshape(-1)
    # np.unique sorts columns; put the all -1 column first so class 0 means "never allowed"
    dead = int(token_class[0])
    order = np.concatenate([[dead], np.delete(np.arange(cols.shape[1]), dead)])
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return TokenAutomaton(token_class=rank[token_class[1:]].astype(np.int32), next=cols[:, order].astype(np.int32),
                          final=np.asarray(final, bool), initial=np.asarray(initial, np.int32),
                          patterns=tuple(patterns), tokenizer=tokenizer)


def stack_automata(automata) -> TokenAutomaton:
    """One automaton holding every pattern of `automata` (a list of TokenAutomaton, each compiled for the
    same tokenizer and vocab_size): states are offset block by block, each pattern keeps its initial
    state (pattern i of the result is the i-th pattern of the inputs, in order), and the token classes
    are the joint ones (tokens that every input puts in the same class share one), so one token_class
    serves all. `stacked.constraint(starts=[...])` then picks a pattern per batch row."""
    autos = list(automata)
    if not autos or not all(isinstance(a, TokenAutomaton) for a in autos):
        raise AutomatonError("stack_automata takes a non-empty list of TokenAutomaton (from compile_regex / "
                             "compile_json_schema)")
    v = {a.vocab_size for a in autos}
    if len(v) > 1:
        raise AutomatonError(f"the automata cover different vocabularies ({sorted(v)} token ids); compile them "
                             "all with the same tokenizer and vocab_size")
    fps = {a.tokenizer for a in autos if a.tokenizer}
    if len(fps) > 1:
        raise AutomatonError("the automata were compiled for different tokenizers; compile them all with the "
                             "model's tokenizer")
    if len(autos) == 1:
        return autos[0]
    cls = np.stack([a.token_class for a in autos], axis=1)  # [V, N]
    # The all-zero row first: joint class 0 is "forbidden everywhere" (np.unique sorts it first).
    joint, token_class = np.unique(np.concatenate([np.zeros((1, len(autos)), cls.dtype), cls]), axis=0,
                                   return_inverse=True)  # joint [Cj, N]
    blocks, offset, initial = [], 0, []
    for i, a in enumerate(autos):
        nxt = a.next[:, joint[:, i]]  # [S_i, Cj]
        blocks.append(np.where(nxt >= 0, nxt + offset, -1).astype(np.int32))
        initial.append(a.initial + offset)
        offset += a.num_states
    return TokenAutomaton(token_class=token_class.reshape(-1)[1:].astype(np.int32), next=np.concatenate(blocks),
                          final=np.concatenate([a.final for a in autos]),
                          initial=np.concatenate(initial).astype(np.int32),
                          patterns=sum((tuple(a.patterns) for a in autos), ()), tokenizer=fps.pop() if fps else "")


def intersect_automata(a: TokenAutomaton, b: TokenAutomaton, pairs=None) -> TokenAutomaton:
    """The product automaton of a and b on the host: texts both accept. pairs: (pattern of a, pattern of
    b) per start state of the result (default: pattern i with pattern i, or every pattern of one with
    the single pattern of the other). Only live product states are kept (dead ends of the pair, which
    neither part alone shows, are pruned); an empty intersection raises AutomatonError."""
    if a.vocab_size != b.vocab_size or (a.tokenizer and b.tokenizer and a.tokenizer != b.tokenizer):
        raise AutomatonError("the automata were compiled for different tokenizers / vocabularies; compile both "
                             "with the model's tokenizer and vocab_size")
    if pairs is None:
        n = max(a.num_patterns, b.num_patterns)
        if {a.num_patterns, b.num_patterns} - {1, n}:
            raise AutomatonError(f"cannot pair {a.num_patterns} patterns with {b.num_patterns}; pass pairs=")
        pairs = [(i if a.num_patterns > 1 else 0, i if b.num_patterns > 1 else 0) for i in range(n)]
    cls = np.stack([a.token_class, b.token_class], axis=1)
    joint, token_joint = np.unique(np.concatenate([np.zeros((1, 2), cls.dtype), cls]), axis=0,
                                   return_inverse=True)  # joint [Cj, 2]; row 0 = (0, 0)
    na, nb = a.next[:, joint[:, 0]], b.next[:, joint[:, 1]]  # [S_a, Cj], [S_b, Cj]
    ids: dict = {}
    order: list = []
    rows: list = []

    def pid(pair):
        if pair not in ids:
            ids[pair] = len(order)
            order.append(pair)
        return ids[pair]

    init = [pid((int(a.initial[i]), int(b.initial[j]))) for i, j in pairs]
    k = 0
    while k < len(order):  # BFS over reachable pairs
        sa, sb = order[k]
        ta, tb = na[sa], nb[sb]
        ok = (ta >= 0) & (tb >= 0)
        row = np.full(ta.shape, -1, np.int64)
        for j in np.flatnonzero(ok):
            row[j] = pid((int(ta[j]), int(tb[j])))
        rows.append(row)
        k += 1
    table = np.stack(rows)  # [P, Cj]
    final = np.array([bool(a.final[x]) and bool(b.final[y]) for x, y in order])
    src, col = np.nonzero(table >= 0)
    live = _live_states(src, table[src, col], len(order), init, final)
    if not live[init].all():
        bad = int(np.flatnonzero(~live[init])[0])
        raise AutomatonError(f"the intersection of {a.patterns[pairs[bad][0]]!r} and {b.patterns[pairs[bad][1]]!r} "
                             "is empty over this tokenizer (no text satisfies both)")
    new_id = np.cumsum(live) - 1
    table = table[live]
    table = np.where((table >= 0) & live[np.maximum(table, 0)], new_id[np.maximum(table, 0)], -1).astype(np.int32)
    cls_auto = _classify(table, new_id[init], final[live], ())  # classes over joint classes
    names = tuple(f"({a.patterns[i]})&({b.patterns[j]})" for i, j in pairs)
    return dataclasses.replace(cls_auto, token_class=cls_auto.token_class[token_joint.reshape(-1)[1:]],
                               patterns=names, tokenizer=a.tokenizer or b.tokenizer)


# ----------------------------------------------------------------------------- compilers
def _cache_dir() -> Path:
    from jaxdecode.files import default_cache_dir
    return default_cache_dir() / "automata"


def _regex_error(pattern: str, err: Exception) -> AutomatonError:
    """outlines-core's message, made specific: a syntax error says where (Python's parser, whose syntax
    agrees with the Rust regex crate's on the common forms); a vocabulary that cannot spell the pattern
    says so."""
    msg = str(err).strip()
    if "anchored universal start state" in msg:
        return AutomatonError(f"cannot compile the regex {pattern!r}: it has an anchor (^ $ \\A \\z \\Z); a "
                              "pattern is always matched whole, so anchors are implicit and not supported: drop "
                              f"them ({msg})")
    if "incompatible with the regex" in msg:
        return AutomatonError(f"the regex {pattern!r} has no accepting path over this tokenizer's tokens: "
                              f"{msg.splitlines()[0]} Fix the pattern, or use a tokenizer that has those "
                              "characters (or byte tokens)")
    if "Unicode word boundaries" in msg:
        return AutomatonError(f"cannot compile the regex {pattern!r}: Unicode word boundaries (\\b, \\B) cannot be "
                              "compiled into a token automaton; write ASCII ones, (?-u:\\b) / (?-u:\\B), or drop "
                              "them")
    try:
        re.compile(pattern)
    except re.error as e:
        return AutomatonError(f"invalid regex {pattern!r}: {e} (fix the pattern; the syntax is that of Rust's "
                              "regex crate)")
    except (OverflowError, RecursionError):
        pass
    return AutomatonError(f"cannot compile the regex {pattern!r}: {msg} (the syntax is that of Rust's regex "
                          "crate: no look-around, no back-references)")


_EMPTY_LOWER_BOUND = re.compile(r"\{\s*,\s*(\d+)\s*\}")
_VERBOSE_FLAG = re.compile(r"\(\?[a-zA-Z]*x")


def check_regex_syntax(pattern: str) -> None:
    """Up-front errors for spellings the compiler (Rust's regex crate via outlines-core) reads differently
    from what was meant, with the fix: anchors (^ $ \\A \\z \\Z outside a character class; a pattern is
    always matched whole, so they are implicit, and outlines-core cannot compile them) and `{,n}` (Python's
    0..n, not Rust syntax: `{0,n}`)."""
    if _VERBOSE_FLAG.search(pattern):  # (?x): whitespace and # comments; leave it to the compiler
        return
    i, n, depth = 0, len(pattern), 0  # depth: nesting of [...] (Rust classes nest)

    def anchor(tok, at):
        literal = f" (a literal {tok} is written \\{tok})" if tok in ("^", "$") else ""
        raise AutomatonError(f"the regex {pattern!r} has the anchor {tok} at position {at}: a pattern is always "
                             f"matched whole (the constrained text from its first character to its last), so "
                             f"anchors (^ $ \\A \\z \\Z) are implicit and not supported; drop it{literal}")

    while i < n:
        c = pattern[i]
        if c == "\\":
            if depth == 0 and pattern[i + 1:i + 2] in ("A", "z", "Z"):
                anchor("\\" + pattern[i + 1], i)
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):  # a leading ] is a literal
                i += 1
            continue
        if depth:
            depth -= c == "]"
        elif c in "^$":
            anchor(c, i)
        elif c == "{":
            m = _EMPTY_LOWER_BOUND.match(pattern, i)
            if m:
                raise AutomatonError(f"the regex {pattern!r} has the repetition {m.group(0)} at position {i}, "
                                     f"which is not Rust regex syntax (the compiler's; Python reads it as "
                                     f"0 to {m.group(1)}): write {{0,{m.group(1)}}}")
        i += 1


def _eos_in_pattern(pattern: str, tokenizer, tb, e: int) -> AutomatonError:
    text = tokenizer.decode([e]) if hasattr(tokenizer, "decode") else tb[e].decode("utf-8", "replace")
    return AutomatonError(
        f"EOS id {e} (token text {text!r}) is also a token of the pattern {pattern!r}: its text is needed to "
        f"spell texts the pattern matches, but an EOS id only ends the output, so they could never be produced. "
        f"Choose other eos_ids (ids whose text the pattern never uses, e.g. the tokenizer's own EOS), or drop "
        f"{text!r} from the pattern")


def compile_regex(pattern: str, tokenizer, *, vocab_size: int | None = None, eos_ids=None,
                  cache: bool = True) -> TokenAutomaton:
    """Token automaton of `pattern` (matched in full) over `tokenizer`'s tokens, via outlines-core.

    vocab_size: the model's vocabulary (>= the tokenizer's; extra ids are never allowed). eos_ids: ids
    left out of the table (they end the text; default the tokenizer's EOS). Compiled automata are cached
    on disk (<jaxdecode.files.default_cache_dir()>/automata) keyed by (pattern, tokenizer bytes,
    vocab_size, eos_ids); an unreadable or damaged cache file is rebuilt."""
    if not isinstance(pattern, str) or not pattern:
        raise AutomatonError(f"a regex must be a non-empty string, got {pattern!r}")
    check_regex_syntax(pattern)
    tb = token_bytes(tokenizer)
    if vocab_size is not None and int(vocab_size) < len(tb):
        raise AutomatonError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tb)} token ids: the "
                             "tokenizer does not belong to this model (pass the model's own tokenizer)")
    v = max(len(tb), int(vocab_size or 0))
    if eos_ids is None:
        eos_ids = () if getattr(tokenizer, "eos_token_id", None) is None else (int(tokenizer.eos_token_id),)
    eos_ids = tuple(int(e) for e in eos_ids)
    fingerprint = tokenizer_fingerprint(tokenizer)
    # "eos-check": automata cached before EOS ids were checked against the pattern are not reused
    key = hashlib.sha256(json.dumps([CACHE_VERSION, pattern, fingerprint, v,
                                     sorted(eos_ids), "eos-check"]).encode()).hexdigest()[:40]
    path = _cache_dir() / f"{key}.npz"
    if cache and path.exists():
        try:
            return TokenAutomaton.load(path)
        except Exception:  # a stale, partial or damaged file: rebuild it
            pass
    import outlines_core

    # EOS ids stay in the map: an EOS id with a live transition is a token the pattern needs (an error,
    # below, unless another token has the same bytes); their edges are dropped from the table after
    mapping: dict[bytes, list[int]] = {}
    for i, b in enumerate(tb):
        if b is not None and b:
            mapping.setdefault(b, []).append(i)
    if END_MARKER in pattern:
        raise AutomatonError(f"the regex contains U+10FFFF, the end marker jaxdecode appends to it (a Unicode "
                             "noncharacter); remove it from the pattern")
    # outlines-core 0.2.14 drops every transition that leaves an accepting state for a non-accepting one
    # (`a(bc)?` never allows the `b`; `[0-9]+(\.[0-9]+)?` never the `.`). So compile (?:R)<marker> with the
    # marker as one extra token (id v): then only the states after the marker accept, no transition is
    # lost, and a state accepts R exactly where the marker token leads on from it. The marker's edges and
    # the states after it are dropped below (from_transitions keeps live states only).
    marker_id, eos_for_oc = v, v + 1  # both outside the table; outlines-core wants an EOS id outside the map
    mapping[END_MARKER.encode("utf-8")] = [marker_id]
    try:
        vocab = outlines_core.Vocabulary(eos_for_oc, mapping)
        index = outlines_core.Index(f"(?:{pattern}){END_MARKER}", vocab)
    except Exception as e:  # outlines-core raises ValueError / its own errors, all with a message
        raise _regex_error(pattern, e) from None
    transitions = index.get_transitions()
    after = set(index.get_final_states())  # states past the end marker: nothing may lead into them
    # accepting: the marker can end the text here (inside R the marker may also be an ordinary character,
    # e.g. of [^"], leading to a non-final state: that edge is not an ending and is dropped with the id)
    finals = {s for s, row in transitions.items() if row.get(marker_id) in after}
    transitions = {s: {t: n for t, n in row.items() if n not in after}
                   for s, row in transitions.items() if s not in after}
    eos_set = set(eos_ids)
    auto = from_transitions(transitions, index.get_initial_state(), finals, v,
                            pattern=pattern, drop_ids=(marker_id, eos_for_oc), tokenizer=fingerprint)
    used = [e for e in eos_ids if 0 <= e < auto.vocab_size and int(auto.token_class[e]) != 0]
    for e in used:  # the pattern needs e's bytes: fine only where another (non-EOS) token spells them
        if not any(t not in eos_set for t in mapping.get(tb[e], ())):
            raise _eos_in_pattern(pattern, tokenizer, tb, e)
    if used:  # twins spell the same texts: drop the EOS ids' edges (without them nothing is lost)
        auto = from_transitions(transitions, index.get_initial_state(), finals, v, pattern=pattern,
                                drop_ids=(marker_id, eos_for_oc) + eos_ids, tokenizer=fingerprint)
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            auto.save(tmp)
            os.replace(tmp, path)
        except OSError:  # a read-only home: compile again next time
            pass
    return auto


# ----------------------------------------------------------------------------- JSON schema
# Keywords outlines-core's converter turns into the regex (with the checks of check_schema).
ENFORCED_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref",
    "minProperties", "minDigits", "maxDigits", "minDigitsInteger", "maxDigitsInteger", "minDigitsFraction",
    "maxDigitsFraction", "minDigitsExponent", "maxDigitsExponent"})
# Annotations: they do not restrict the valid instances (keys starting with "x-" count as annotations).
ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "$defs",
    "definitions", "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding",
    "contentSchema", "$vocabulary", "discriminator"})  # discriminator: OpenAPI / pydantic's hint for oneOf
# Keywords the converter silently ignores (or mistranslates): each raises, with what to do instead.
UNSUPPORTED_KEYWORDS = {
    "minimum": "numeric bounds", "maximum": "numeric bounds", "exclusiveMinimum": "numeric bounds",
    "exclusiveMaximum": "numeric bounds", "multipleOf": "divisibility", "uniqueItems": "unique array items",
    "contains": "'contains'", "minContains": "'contains'", "maxContains": "'contains'",
    "patternProperties": "pattern-matched property names", "propertyNames": "property-name schemas",
    "dependentRequired": "dependent properties", "dependentSchemas": "dependent schemas",
    "dependencies": "dependent properties", "maxProperties": "a maximum property count",
    "unevaluatedProperties": "unevaluated properties", "unevaluatedItems": "unevaluated items",
    "not": "negation", "if": "conditionals", "then": "conditionals", "else": "conditionals",
    "$dynamicRef": "dynamic references", "$dynamicAnchor": "dynamic references",
    "$recursiveRef": "recursive references", "$recursiveAnchor": "recursive references"}
SUPPORTED_FORMATS = frozenset({"date-time", "date", "time", "email", "uri", "uuid"})
_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _same_length_ranges(a: int, b: int, width: int) -> list[str]:
    """Regex pieces for the integers a..b, all of `width` digits (a = 0 only for width 1): each piece
    is a fixed prefix, one digit range and free digits ([0-9]{p})."""
    out = []
    while a <= b:
        p = 0  # the widest block of 10^p numbers that starts at a and fits
        while p + 1 < width and a % 10 ** (p + 1) == 0 and a + 10 ** (p + 1) - 1 <= b:
            p += 1
        step = 10 ** p
        k = min((b - a + 1) // step, 10 - (a // step) % 10)  # how many such blocks, same higher digits
        x, y = str(a).zfill(width), str(a + k * step - 1).zfill(width)
        i = width - p - 1
        digit = x[i] if x[i] == y[i] else f"[{x[i]}-{y[i]}]"
        out.append(x[:i] + digit + ("" if p == 0 else "[0-9]" if p == 1 else f"[0-9]{{{p}}}"))
        a += k * step
    return out


def _nonneg_range(a: int, b: int | None) -> str:
    """Regex (an alternation) of the decimal integers a..b without leading zeros (b None: unbounded)."""
    pieces, width = [], len(str(a))
    while True:
        top = 10 ** width - 1
        if b is not None and b <= top:
            return "|".join(pieces + _same_length_ranges(a, b, width))
        pieces += _same_length_ranges(a, top, width)
        if b is None:
            return "|".join(pieces + [f"[1-9][0-9]{{{width},}}"])
        a, width = 10 ** width, width + 1


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """Regex of the JSON integers in [lo, hi] (None: unbounded), as outlines-core writes integers (no
    leading zeros, no '-0')."""
    parts = []
    if lo is None or lo < 0:  # negatives -n, n in [max(1, -hi), -lo]
        n_lo = 1 if hi is None or hi >= 0 else -hi
        n_hi = None if lo is None else -lo
        if n_hi is None or n_lo <= n_hi:
            parts.append(f"-({_nonneg_range(n_lo, n_hi)})")
    if hi is None or hi >= 0:
        parts.append(_nonneg_range(0 if lo is None else max(lo, 0), hi))
    return "(" + "|".join(parts) + ")"


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _int_bounds(sub: dict, fail) -> tuple[int | None, int | None]:
    """The inclusive integer range [lo, hi] of an integer schema's numeric bounds."""
    import math

    lo = hi = None
    for key in _BOUNDS:
        if key not in sub:
            continue
        x = sub[key]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            fail(f"{key} must be a finite number, got {x!r}")
        v = {"minimum": math.ceil(x), "exclusiveMinimum": math.floor(x) + 1, "maximum": math.floor(x),
             "exclusiveMaximum": math.ceil(x) - 1}[key]
        if key.endswith("inimum"):
            lo = v if lo is None else max(lo, v)
        else:
            hi = v if hi is None else min(hi, v)
    if lo is not None and hi is not None and lo > hi:
        fail(f"no integer lies in the bounds ({', '.join(f'{k}={sub[k]}' for k in _BOUNDS if k in sub)}): an "
             "empty language")
    return lo, hi


def _bounded_integer(sub) -> bool:
    return isinstance(sub, dict) and sub.get("type") == "integer" and any(k in sub for k in _BOUNDS)


class _SchemaWalk:
    """check_schema's walk: every reachable subschema once, with its JSON path; $refs followed with a
    stack (a $ref met again inside its own expansion is recursion)."""

    def __init__(self, root):
        self.root = root
        self.done: set[str] = set()
        self.validator = None

    def fail(self, path: str, msg: str):
        raise AutomatonError(f"JSON schema at {path}: {msg}")

    def resolve(self, ref: str, path: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            self.fail(path, f"$ref {ref!r} is not a local reference ('#/$defs/...'); inline the referenced schema")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                self.fail(path, f"$ref {ref!r} does not resolve inside the schema")
        return node

    def deref(self, sub, path: str, depth: int = 0):
        while isinstance(sub, dict) and "$ref" in sub and depth < 32:
            sub, depth = self.resolve(sub["$ref"], path), depth + 1
        return sub

    def types_of(self, sub, path: str) -> set | None:
        """The JSON types a subschema admits (None: not determined by type / const / enum)."""
        sub = self.deref(sub, path)
        if isinstance(sub, dict):
            if "const" in sub:
                return {_json_type(sub["const"])}
            if "enum" in sub and isinstance(sub["enum"], list):
                return {_json_type(x) for x in sub["enum"]}
            t = sub.get("type")
            if isinstance(t, str):
                return {t}
            if isinstance(t, list):
                return set(t)
        return None

    def values_of(self, sub, path: str) -> set | None:
        """The values a subschema admits when it lists them (const / enum), canonical JSON; else None."""
        sub = self.deref(sub, path)
        if isinstance(sub, dict):
            if "const" in sub:
                return {json.dumps(sub["const"], sort_keys=True)}
            if isinstance(sub.get("enum"), list):
                return {json.dumps(x, sort_keys=True) for x in sub["enum"]}
        return None

    def disjoint(self, a, b, path: str) -> bool:
        """Can no value satisfy both subschemas? Decided by types (integer lies within number), by listed
        values, or by a property both objects require whose listed values differ (a discriminator)."""
        ta, tb = self.types_of(a, path), self.types_of(b, path)
        if ta is not None and tb is not None:
            num = {"integer", "number"}
            if not (ta & tb) and not (ta & num and tb & num):
                return True
        va, vb = self.values_of(a, path), self.values_of(b, path)
        if va is not None and vb is not None:
            return not (va & vb)
        a, b = self.deref(a, path), self.deref(b, path)
        if isinstance(a, dict) and isinstance(b, dict):
            shared = set(a.get("required") or []) & set(b.get("required") or [])
            for name in sorted(shared):
                pa = (a.get("properties") or {}).get(name)
                pb = (b.get("properties") or {}).get(name)
                if pa is not None and pb is not None and self.disjoint(pa, pb, path):
                    return True
        return False

    def check_values(self, sub: dict, path: str):
        """enum / const next to other assertions: outlines-core emits the listed values as they are, so
        each must satisfy the sibling keywords."""
        rest = {k: v for k, v in sub.items() if k not in ("enum", "const") and k not in ANNOTATION_KEYWORDS}
        if not rest:
            return
        import jsonschema

        if self.validator is None:
            cls = jsonschema.validators.validator_for(self.root, default=jsonschema.Draft202012Validator)
            self.validator = cls(self.root)
        v = self.validator.evolve(schema=rest)
        values = [sub["const"]] if "const" in sub else list(sub.get("enum") or [])
        for x in values:
            err = jsonschema.exceptions.best_match(v.iter_errors(x))
            if err is not None:
                self.fail(path, f"the value {json.dumps(x)} of {'const' if 'const' in sub else 'enum'} fails its "
                          f"sibling keywords ({err.message}); outlines-core would emit it anyway: remove it")

    def check_keys(self, sub: dict, path: str):
        """Every keyword is enforced, an annotation, or an error naming it."""
        bounded = _bounded_integer(sub)
        for key in sub:
            if key in ENFORCED_KEYWORDS or _is_annotation(key):
                continue
            if bounded and key in _BOUNDS:  # compiled here (int_range_regex), not by outlines-core
                continue
            what = UNSUPPORTED_KEYWORDS.get(key)
            if what is not None:
                hint = (" (numeric bounds are compiled for schemas of type 'integer' only)" if key in _BOUNDS
                        else "")
                self.fail(path, f"keyword {key!r} ({what}) is not supported by the regex compiler{hint}: "
                          "outlines-core would silently ignore it and admit values the schema rejects. Remove it, "
                          "or use the grammar path (jaxdecode.constraints.grammar)")
            self.fail(path, f"unknown keyword {key!r}: the regex compiler does not know it, so it would be "
                      "ignored; remove it, or prefix an annotation with 'x-'")

    def scan_keys(self, sub, path: str):
        """check_keys over the schema as written (before _normalize), so errors name the user's paths."""
        if not isinstance(sub, dict):
            return
        self.check_keys(sub, path)
        for key in ("properties", "$defs", "definitions"):
            if isinstance(sub.get(key), dict):
                for k, v in sub[key].items():
                    self.scan_keys(v, f"{path}.{key}.{k}")
        for key in ("additionalProperties", "items"):
            self.scan_keys(sub.get(key), f"{path}.{key}")
        for key in ("prefixItems",) + _COMBINATORS:
            if isinstance(sub.get(key), list):
                for i, v in enumerate(sub[key]):
                    self.scan_keys(v, f"{path}.{key}[{i}]")

    def walk(self, sub, path: str, stack: tuple = ()):
        if isinstance(sub, bool):
            if sub is False:
                self.fail(path, "the schema `false` admits no value (an empty language); remove it")
            self.fail(path, "a boolean schema `true` is not supported by the converter; write {} for any value")
        if not isinstance(sub, dict):
            self.fail(path, f"a schema must be an object, got {type(sub).__name__}")
        bounded = _bounded_integer(sub)
        self.check_keys(sub, path)
        t = sub.get("type")
        for ty in ([t] if isinstance(t, str) else t if isinstance(t, list) else [] if t is None else [None]):
            if ty not in _TYPES:
                self.fail(path, f"type {t!r} is not a JSON type (one of {', '.join(_TYPES)})")
        if "format" in sub and sub["format"] not in SUPPORTED_FORMATS:
            self.fail(path, f"format {sub['format']!r} is not supported by outlines-core (it knows "
                      f"{', '.join(sorted(SUPPORTED_FORMATS))}); remove it or give a 'pattern'")
        if "enum" in sub and (not isinstance(sub["enum"], list) or not sub["enum"]):
            self.fail(path, f"enum must be a non-empty list (an empty one admits no value), got {sub['enum']!r}")
        if "enum" in sub or "const" in sub:
            self.check_values(sub, path)
        elif bounded:
            _int_bounds(sub, lambda msg: self.fail(path, msg))
            other = sorted(k for k in sub if k not in _BOUNDS and k != "type" and k not in ANNOTATION_KEYWORDS
                           and not k.startswith("x-"))
            if other:
                self.fail(path, f"keyword {other[0]!r} next to numeric bounds is not supported; express the "
                          "bounds alone (minimum / maximum) or drop them")
        if "pattern" in sub:
            if not isinstance(sub["pattern"], str):
                self.fail(path, f"pattern must be a string, got {sub['pattern']!r}")
            json_string_pattern(sub["pattern"], f"JSON schema at {path}")
        kinds = [k for k, keys in (("pattern", ("pattern",)), ("format", ("format",)),
                                   ("minLength / maxLength", ("minLength", "maxLength"))) if any(x in sub for x in keys)]
        if len(kinds) > 1:
            self.fail(path, f"{kinds[0]} and {kinds[1]} together: outlines-core compiles only one of pattern, format "
                      "and length bounds (and drops the others); keep one (a length can go into the pattern, "
                      "e.g. '^[a-z]{0,8}$')")
        for key in _COUNT_KEYWORDS:
            v = sub.get(key)
            if key in sub and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                self.fail(path, f"{key} must be a non-negative integer, got {v!r}")
        for lo, hi in (("minLength", "maxLength"), ("minItems", "maxItems")):
            if isinstance(sub.get(lo), int) and isinstance(sub.get(hi), int) and sub[lo] > sub[hi]:
                self.fail(path, f"{lo}={sub[lo]} > {hi}={sub[hi]}: no value fits (an empty language)")
        props = sub.get("properties")
        if props is not None and not isinstance(props, dict):
            self.fail(path, "'properties' must be an object")
        for name in props or {}:
            if any(c in name for c in '"\\') or any(ord(c) < 0x20 for c in name):
                self.fail(path, f"property name {name!r} holds a character JSON must escape, which outlines-core "
                          "writes raw (the output would not be JSON); rename the property")
        if "minProperties" in sub and props:
            self.fail(path, "keyword 'minProperties' next to 'properties' is ignored by outlines-core; make the "
                      "properties 'required' instead")
        missing = [r for r in sub.get("required") or [] if r not in (props or {})]
        if missing:
            self.fail(path, f"required property {missing[0]!r} is not in 'properties' (outlines-core would drop "
                      "it from the output); declare it under 'properties'")
        if isinstance(sub.get("items"), list):
            self.fail(path, "'items' as a list (draft-04 tuples) is not supported; use 'prefixItems'")
        if "allOf" in sub and (not isinstance(sub["allOf"], list) or len(sub["allOf"]) != 1):
            self.fail(path, "'allOf' with several schemas is not supported: outlines-core concatenates them "
                      "instead of intersecting; merge them into one schema (or use the grammar path)")
        if "oneOf" in sub:
            branches = sub["oneOf"] if isinstance(sub["oneOf"], list) else []
            for i in range(len(branches)):
                for j in range(i):
                    if not self.disjoint(branches[j], branches[i], path):
                        self.fail(path, f"'oneOf' is compiled as 'anyOf' (a value matching two branches would "
                                  f"pass), so its branches must be disjoint, and branches {j} and {i} may overlap "
                                  "(disjoint: different types, different listed values, or a required property "
                                  "with different const / enum values). Use 'anyOf' if they never overlap")
        # ---- children
        if "$ref" in sub:
            ref = sub["$ref"]
            siblings = sorted(k for k in sub if k != "$ref" and k not in ANNOTATION_KEYWORDS
                              and not k.startswith("x-"))
            if siblings:
                self.fail(path, f"keyword {siblings[0]!r} next to '$ref' is ignored by outlines-core (it compiles "
                          "only the referenced schema); move it into the referenced schema or wrap both in "
                          "one schema")
            if ref in stack:
                cycle = " -> ".join(stack[stack.index(ref):] + (ref,))
                raise AutomatonError(f"JSON schema at {path}: the schema is recursive ($ref cycle {cycle}); a "
                                     "regex cannot hold it: use compile_grammar / json_schema via the grammar "
                                     "path (jaxdecode.constraints.grammar)")
            if ref not in self.done:
                self.walk(self.resolve(ref, path), f"{path}.$ref({ref})", stack + (ref,))
                self.done.add(ref)
        for name, s in (props or {}).items():
            self.walk(s, f"{path}.properties.{name}", stack)
        for key in ("additionalProperties", "items"):
            if isinstance(sub.get(key), dict):
                self.walk(sub[key], f"{path}.{key}", stack)
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if key in sub:
                if not isinstance(sub[key], list) or not sub[key]:
                    self.fail(path, f"{key!r} must be a non-empty list of schemas")
                for i, s in enumerate(sub[key]):
                    self.walk(s, f"{path}.{key}[{i}]", stack)


def _load_schema(schema):
    if isinstance(schema, (str, Path)) and not str(schema).lstrip().startswith(("{", "[")) and Path(schema).is_file():
        schema = Path(schema).read_text()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise AutomatonError(f"the JSON schema is not valid JSON ({e}); pass a dict, JSON text or a file "
                                 "path") from None
    return schema


_ANY_TYPE = {"type": list(_TYPES[:2]) + list(_TYPES[3:])}  # every JSON type (integer is within number)


# Characters a JSON string cannot hold raw: '"', '\\' and the controls U+0000..U+001F (class syntax).
_JSON_RAW_FORBIDDEN = '"\\\\\\x00-\\x1f'
_CATEGORY = {"CATEGORY_DIGIT": r"\d", "CATEGORY_WORD": r"\w", "CATEGORY_SPACE": " "}  # \s: a space (narrower)
_NOT_CATEGORY = {"CATEGORY_NOT_DIGIT": r"\d", "CATEGORY_NOT_WORD": r"\w", "CATEGORY_NOT_SPACE": r"\s"}


def _class_char(c: int) -> str:
    ch = chr(c)
    return "\\" + ch if ch in "\\]^-[&~" else ch


def _json_literal(c: int) -> str:
    """Regex of the JSON text of one character: its escape for '"', '\\' and controls."""
    return re.escape(json.dumps(chr(c), ensure_ascii=False)[1:-1])


def json_string_pattern(pattern: str, where: str = "pattern") -> str:
    """A JSON-schema `pattern` as a regex over the JSON text between the quotes. outlines-core pastes
    the pattern in raw, so `[^@]+` or `.` could emit a raw '"' (ending the string early) or a newline,
    and `x|y` binds to the quotes; here the pattern is parsed (Python's re, what jsonschema validates
    with) and written out again: wrapped in a group, literal '"' / '\\' / controls as their JSON
    escapes, '.' and negated classes without those characters, positive classes without them (a
    narrower language, never a wider one), \\s as a space. Anchors ^ / $ at the ends are dropped (the
    regex matches the whole string: narrower than JSON schema's search, never wider); back-references,
    look-around and inline flags raise AutomatonError."""
    import re._constants as C
    import re._parser as P

    try:
        parsed = P.parse(pattern)
    except re.error as e:
        raise AutomatonError(f"{where}: the pattern {pattern!r} is not a regex Python's re reads ({e}), which "
                             "jsonschema validates with; rewrite it (e.g. \\p{{...}} classes as explicit ranges)") \
            from None
    if parsed.state.flags & (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
        raise AutomatonError(f"{where}: inline flags in {pattern!r} are not supported; spell the cases out")

    def unsupported(what):
        raise AutomatonError(f"{where}: {what} in the pattern {pattern!r} is not supported by the regex compiler "
                             "(no back-references or look-around); rewrite the pattern without it")

    def items_class(items, negate: bool) -> list[str]:
        """Pieces of a character class: (class body, alternatives outside the class)."""
        body, extra = [], []
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                if negate or not (av < 0x20 or chr(av) in '"\\'):
                    body.append(_class_char(av))
            elif name == "RANGE":
                lo, hi = av
                for a, b in _split_range(lo, hi) if not negate else [(lo, hi)]:
                    body.append(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}")
            elif name == "CATEGORY":
                cat = str(av)
                if cat in _CATEGORY and not (negate and cat == "CATEGORY_SPACE"):
                    body.append(_CATEGORY[cat])
                elif negate and cat == "CATEGORY_SPACE":
                    body.append(r"\s")
                elif cat in _NOT_CATEGORY and not negate:
                    extra.append(f"[^{_NOT_CATEGORY[cat]}{_JSON_RAW_FORBIDDEN}]")
                else:
                    unsupported(f"the class item {cat}")
            else:
                unsupported(f"the class item {name}")
        return body, extra

    def emit(seq, top=False) -> str:
        out = []
        n = len(seq)
        for i, (op, av) in enumerate(seq):
            name = str(op)
            if name == "LITERAL":
                out.append(_json_literal(av))
            elif name == "NOT_LITERAL":
                out.append(f"[^{_class_char(av)}{_JSON_RAW_FORBIDDEN}]")
            elif name == "ANY":
                out.append(f"[^{_JSON_RAW_FORBIDDEN}]")
            elif name == "IN":
                negate = bool(av) and str(av[0][0]) == "NEGATE"
                body, extra = items_class(av[1:] if negate else av, negate)
                if negate:
                    out.append(f"[^{''.join(body)}{_JSON_RAW_FORBIDDEN}]")
                else:
                    alts = ([f"[{''.join(body)}]"] if body else []) + extra
                    out.append("(?:" + "|".join(alts) + ")" if alts else "[^\\x00-\\U0010ffff]")  # nothing
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = av
                hi_s = "" if hi == C.MAXREPEAT else str(hi)
                out.append(f"(?:{emit(sub)}){{{lo},{hi_s}}}" if hi_s != str(lo) else f"(?:{emit(sub)}){{{lo}}}")
            elif name == "SUBPATTERN":
                group, add, rem, sub = av
                if add or rem:
                    raise AutomatonError(f"{where}: inline flags in {pattern!r} are not supported")
                out.append(f"(?:{emit(sub)})")
            elif name == "ATOMIC_GROUP":
                out.append(f"(?:{emit(av)})")
            elif name == "BRANCH":
                out.append("(?:" + "|".join(emit(b) for b in av[1]) + ")")
            elif name == "AT":
                at = str(av)
                if top and ((i == 0 and at in ("AT_BEGINNING", "AT_BEGINNING_STRING"))
                            or (i == n - 1 and at in ("AT_END", "AT_END_STRING"))):
                    continue
                unsupported(f"the anchor {at} (not at an end)")
            elif name == "GROUPREF" or name == "GROUPREF_EXISTS":
                unsupported("a back-reference")
            elif name in ("ASSERT", "ASSERT_NOT"):
                unsupported("look-around")
            else:
                unsupported(name)
        return "".join(out)

    return "(?:" + emit(parsed.data, top=True) + ")"


def _split_range(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi] without the JSON-forbidden code points ('"', '\\', U+0000..U+001F)."""
    out, a = [], max(lo, 0x20)
    for bad in (0x22, 0x5C):
        if a <= bad <= hi:
            if a < bad:
                out.append((a, bad - 1))
            a = bad + 1
    if a <= hi:
        out.append((a, hi))
    return out


def _has_object(x) -> bool:
    if isinstance(x, dict):
        return True
    return isinstance(x, list) and any(_has_object(v) for v in x)


def _json_value_regex(v, ws: str) -> str:
    """Regex of one JSON value's text, with `ws` (outlines-core's whitespace pattern) around the
    structural characters as outlines-core writes them."""
    if isinstance(v, dict):
        if not v:
            return rf"\{{{ws}\}}"
        items = f"{ws},{ws}".join(re.escape(json.dumps(k, ensure_ascii=False)) + f"{ws}:{ws}" + _json_value_regex(x, ws)
                                  for k, x in v.items())
        return rf"\{{{ws}{items}{ws}\}}"
    if isinstance(v, list):
        if not v:
            return rf"\[{ws}\]"
        return rf"\[{ws}" + f"{ws},{ws}".join(_json_value_regex(x, ws) for x in v) + rf"{ws}\]"
    return re.escape(json.dumps(v, ensure_ascii=False))


def _rewrite(schema, markers: dict, top: bool = True):
    """A copy of the schema for outlines-core's converter: every nested schema that asserts nothing ({}
    or annotations only) written as a list of every type (outlines-core emits {} as a bare top-level
    alternation, which inside an array or object breaks the surrounding pattern: `{"a": {}}` would match
    `[1,2]`), and every bounded integer schema (reached through properties, items, ...) replaced by a
    string const marker whose quoted literal in the regex is then swapped for int_range_regex
    (markers: marker -> regex)."""
    if not isinstance(schema, dict):
        return schema
    if _bounded_integer(schema) and "enum" not in schema and "const" not in schema:
        marker = f"jxdint{len(markers)}x{os.getpid()}q"
        markers[marker] = int_range_regex(*_int_bounds(schema, lambda m: None))
        return {"const": marker}
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and _has_object(values):
        # outlines-core writes the keys of object values unescaped ('k.' would match 'kX'): own regex
        marker = f"jxdval{len(markers)}x{os.getpid()}q"
        markers[marker] = "(" + "|".join(_json_value_regex(v, markers.get("", "[ ]?")) for v in values) + ")"
        return {"const": marker}
    if all(_is_annotation(k) for k in schema):  # asserts nothing (annotations only)
        keep = {k: v for k, v in schema.items() if k in ("$defs", "definitions")}
        return keep if top else dict(_ANY_TYPE)
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = json_string_pattern(out["pattern"])
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _rewrite(v, markers, False) for k, v in out[key].items()}
    for key in ("additionalProperties", "items"):
        if isinstance(out.get(key), dict):
            out[key] = _rewrite(out[key], markers, False)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_rewrite(v, markers, False) for v in out[key]]
    return out


_TYPE_KEYWORDS = {  # the keywords that constrain only values of one JSON type (others pass them)
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": _BOUNDS + ("multipleOf", "minDigits", "maxDigits", "minDigitsInteger", "maxDigitsInteger",
                         "minDigitsFraction", "maxDigitsFraction", "minDigitsExponent", "maxDigitsExponent"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
              "maxContains", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "minProperties", "maxProperties",
               "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
               "unevaluatedProperties")}
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "minDigits", "maxDigits",
                   "minDigitsInteger", "maxDigitsInteger", "minDigitsFraction", "maxDigitsFraction",
                   "minDigitsExponent", "maxDigitsExponent")


def _is_annotation(key: str) -> bool:
    return key in ANNOTATION_KEYWORDS or key.startswith("x-")


def _type_set(t) -> set:
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _merge_into(branch: dict, siblings: dict, where: str):
    """branch AND siblings as one schema (None: no value can satisfy both types). Types intersect
    (integer within number), properties and required merge, other keywords must agree."""
    out = dict(branch)
    for key, val in siblings.items():
        if key not in out or out[key] == val:
            out[key] = val
        elif key == "type":
            a, b = _type_set(out[key]), _type_set(val)
            both = (a & b) | ({"integer"} if ("integer" in a and "number" in b) or ("number" in a and "integer" in b)
                              else set())
            if not both:
                return None
            out[key] = sorted(both)[0] if len(both) == 1 else sorted(both)
        elif key == "properties" and isinstance(val, dict) and isinstance(out[key], dict) and all(
                out[key][n] == v for n, v in val.items() if n in out[key]):
            out[key] = {**out[key], **val}
        elif key == "required" and isinstance(val, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys(out[key] + val))
        else:
            raise AutomatonError(f"JSON schema at {where}: keyword {key!r} is given twice with different values "
                                 "(next to a combinator and in its branch, or in two allOf branches); merge them "
                                 "by hand")
    return out


def _normalize(sub, path: str = "$", top: bool = True):
    """The schema in the forms outlines-core translates faithfully, with the same instances: `true`
    subschemas as "any type" (and `items` / `additionalProperties: true` dropped: no constraint);
    keywords next to anyOf / oneOf / allOf moved into each branch (outlines-core compiles either the
    combinator or its siblings, not both; a branch whose type cannot meet the siblings' is dropped); a
    schema without "type" whose keywords constrain one type only (`{"maxLength": 2}`) as an anyOf over
    the JSON types, each with its keywords."""
    if sub is True:
        return {} if top else dict(_ANY_TYPE)
    if not isinstance(sub, dict):
        return sub  # `false` and non-schemas: check_schema names them
    out = dict(sub)
    combs = [k for k in _COMBINATORS if k in out]
    siblings = {k: v for k, v in out.items() if k not in _COMBINATORS and not _is_annotation(k)}
    if combs and siblings:  # distribute first, so each branch is normalized with the siblings in it
        if len(combs) > 1 or not isinstance(out[combs[0]], list):
            raise AutomatonError(f"JSON schema at {path}: keywords next to {' and '.join(combs)} are not "
                                 "supported; move them into the branches")
        k = combs[0]
        branches = []
        for i, b in enumerate(out[k]):
            b = {} if b is True else b
            if not isinstance(b, dict) or "$ref" in b:
                raise AutomatonError(f"JSON schema at {path}.{k}[{i}]: keyword {sorted(siblings)[0]!r} next to "
                                     f"'{k}' must be moved into each branch, and this branch is a $ref or not "
                                     "an object; write the branch out with the keyword in it")
            merged = _merge_into(b, siblings, f"{path}.{k}[{i}]")
            if merged is not None:
                branches.append(merged)
        if not branches:
            raise AutomatonError(f"JSON schema at {path}: no branch of '{k}' can meet the type next to it (an "
                                 "empty language)")
        out = {**{x: v for x, v in out.items() if _is_annotation(x)}, k: branches}
    branches = out.get("allOf")
    if isinstance(branches, list) and len(branches) > 1 and all(
            isinstance(b, dict) and "$ref" not in b and not any(k in b for k in _COMBINATORS) for b in branches):
        merged = {}  # allOf of plain schemas: one schema (outlines-core would concatenate them)
        for i, b in enumerate(branches):
            merged = _merge_into(merged, {k: v for k, v in b.items() if not _is_annotation(k)},
                                 f"{path}.allOf[{i}]")
            if merged is None:
                raise AutomatonError(f"JSON schema at {path}: the types of 'allOf' have nothing in common (an "
                                     "empty language)")
        out = {**{x: v for x, v in out.items() if x != "allOf"}, "allOf": [merged]}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _normalize(v, f"{path}.{key}.{k}", False) for k, v in out[key].items()}
    for key in ("additionalProperties", "items"):
        if out.get(key) is True:
            del out[key]
        elif isinstance(out.get(key), dict):
            out[key] = _normalize(out[key], f"{path}.{key}", False)
    for key in ("prefixItems",) + _COMBINATORS:
        if isinstance(out.get(key), list):
            out[key] = [_normalize(v, f"{path}.{key}[{i}]", False) for i, v in enumerate(out[key])]
    for key in _COUNT_KEYWORDS:  # JSON numbers: 2.0 is the count 2 (outlines-core ignores a float)
        v = out.get(key)
        if isinstance(v, float) and v.is_integer():
            out[key] = int(v)
    typed = {t: [x for x in kws if x in out] for t, kws in _TYPE_KEYWORDS.items()}
    if ("type" not in out and not any(k in out for k in _COMBINATORS)
            and not {"enum", "const", "$ref"} & set(out) and any(typed.values())):
        branches = [{"type": t, **{x: out[x] for x in typed[t]}} for t in ("string", "number", "array", "object")]
        branches += [{"type": "boolean"}, {"type": "null"}]
        out = {**{x: v for x, v in out.items() if _is_annotation(x)}, "anyOf": branches}
    return out


def check_schema(schema) -> None:
    """Raise AutomatonError, naming the keyword and its JSON path, for anything in the schema the regex
    compiler would not enforce (UNSUPPORTED_KEYWORDS, unknown keywords, unknown formats, 'allOf' with
    several schemas, 'oneOf' over overlapping types, enum values that fail their sibling keywords,
    'required' names missing from 'properties', recursive $refs) or that admits nothing."""
    _SchemaWalk(schema).scan_keys(schema, "$")
    schema = _normalize(schema)
    _SchemaWalk(schema).walk(schema, "$")


def schema_to_regex(schema, *, whitespace: str | None = None, check: bool = True) -> str:
    """outlines-core's JSON schema -> regex converter (schema: a dict, a JSON string or a file path),
    after check_schema, with integer bounds (minimum / maximum / exclusive*) compiled here (check=False
    skips both: keywords outlines-core ignores are then dropped)."""
    import outlines_core

    schema = _load_schema(schema)
    if check:
        _SchemaWalk(schema).scan_keys(schema, "$")
        schema = _normalize(schema)
        _SchemaWalk(schema).walk(schema, "$")
    markers: dict = {"": "[ ]?" if whitespace is None else f"(?:{whitespace})"}  # "": the whitespace
    rewritten = _rewrite(schema, markers) if check else schema
    markers.pop("")
    text = json.dumps(rewritten)
    try:
        regex = outlines_core.json_schema.build_regex_from_schema(text, whitespace)
    except Exception as e:
        raise AutomatonError(f"cannot convert the JSON schema to a regex: {str(e).strip().splitlines()[0]}") \
            from None
    for marker, sub in markers.items():
        if json.dumps(schema).count(marker) or f'"{marker}"' not in regex:
            raise AutomatonError("internal: an integer-range marker collided with the schema's text or was not "
                                 "emitted; drop the numeric bounds")
        regex = regex.replace(f'"{marker}"', sub)
    return regex


def compile_json_schema(schema, tokenizer, *, whitespace: str | None = None, **kw) -> TokenAutomaton:
    """Token automaton of the texts valid under a JSON schema (check_schema, outlines-core's converter,
    then compile_regex)."""
    return compile_regex(schema_to_regex(schema, whitespace=whitespace), tokenizer, **kw)


def per_row_constraint(specs, tokenizer, *, vocab_size: int | None = None, eos_ids=None, impl: str = "auto",
                       mask: str = "auto", cache: bool = True) -> "AutomatonConstraint":
    """The constraint of a batch whose rows follow different patterns: specs[b] is row b's regex (a str),
    JSON schema (a dict) or TokenAutomaton. Equal specs are compiled once; all are stacked."""
    specs = list(specs)
    if not specs:
        raise AutomatonError("per_row_constraint needs one spec per batch row, got none")
    index: dict[str, int] = {}
    autos, starts = [], []
    for b, spec in enumerate(specs):
        if isinstance(spec, TokenAutomaton):
            key = f"auto:{id(spec)}"
        elif isinstance(spec, str):
            key = "re:" + spec
        elif isinstance(spec, dict):
            key = "js:" + json.dumps(spec)  # property order matters: the output follows it
        else:
            raise AutomatonError(f"specs[{b}] is a {type(spec).__name__}; give a regex (str), a JSON schema "
                                 "(dict) or a TokenAutomaton per row")
        if key not in index:
            kw = dict(vocab_size=vocab_size, eos_ids=eos_ids, cache=cache)
            if isinstance(spec, TokenAutomaton):
                a = spec
            elif isinstance(spec, str):
                a = compile_regex(spec, tokenizer, **kw)
            else:
                a = compile_json_schema(spec, tokenizer, **kw)
            if a.num_patterns != 1:
                raise AutomatonError(f"specs[{b}] is already a stack of {a.num_patterns} patterns; give one "
                                     "pattern per row")
            index[key] = len(autos)
            autos.append(a)
        starts.append(index[key])
    return stack_automata(autos).constraint(starts=starts, impl=impl, mask=mask)


# ----------------------------------------------------------------------------- device constraint
@dataclasses.dataclass(frozen=True)
class AutomatonState:
    """One automaton state per row: node = (int32[R],); -1 = finished (emitted EOS) or dead. `node` is a
    tuple as in TrieState, so decoders that carry `state.node` (beam search) take either."""
    node: tuple

    @property
    def state(self):
        return self.node[0]

    def replace(self, **kw) -> "AutomatonState":
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(AutomatonState, data_fields=["node"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class AutomatonConstraint:
    """The Constraint protocol (see jaxdecode.constraints.protocol) over a TokenAutomaton. A pytree."""
    token_class: jax.Array  # int32[V]
    next: jax.Array  # int32[S, C]
    final: jax.Array  # bool[S]
    initial: jax.Array  # int32[B] (per_row) or int32[1]: start state of each batch row
    bits: jax.Array | None = None  # uint32[S, ceil(V / 32)]: the packed mask rows (None: the class path)
    per_row: bool = False
    eos_ids: tuple = ()
    impl: str = "auto"
    host: TokenAutomaton | None = None  # not part of the pytree

    def replace(self, **kw) -> "AutomatonConstraint":
        return dataclasses.replace(self, **kw)

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None) -> "AutomatonConstraint":
        eos_ids = tuple(int(e) for e in eos_ids)
        if self.vocab_size > vocab_size:
            raise ConstraintError(f"the automaton covers {self.vocab_size} token ids but the model's vocabulary "
                                  f"has {vocab_size}; compile it with this model's tokenizer (vocab_size="
                                  f"{vocab_size})")
        if self.per_row and batch is not None and self.initial.shape[0] != batch:
            raise ConstraintError(f"the constraint has start states for {self.initial.shape[0]} rows but the "
                                  f"batch has {batch}; pass one pattern per prompt")
        if self.host is not None:
            if not eos_ids and self.host.final.any():
                tail = self.host.next[self.host.final]
                if (tail >= 0).any():  # accepting states that can continue: only an EOS can say "stop here"
                    raise ConstraintError("this pattern accepts texts that continue other accepted texts, "
                                          "which only an EOS token can end: pass eos_ids")
            for e in eos_ids:
                if 0 <= e < self.vocab_size and int(self.host.token_class[e]) != 0:
                    raise ConstraintError(f"EOS id {e} is also a token of the pattern; compile the automaton "
                                          f"with eos_ids including {e}")
        return self.replace(eos_ids=eos_ids)

    def init(self, batch: int, beams: int = 1) -> AutomatonState:
        init = jnp.broadcast_to(self.initial, (batch,)) if not self.per_row else self.initial
        return AutomatonState(node=(jnp.repeat(init.astype(jnp.int32), beams),))

    def allowed(self, state: AutomatonState, width: int | None = None):
        """bool[R, width]: tokens each row may emit (EOS ids exactly at accepting states). From the packed
        bitmask rows when the constraint carries them, else next[s][token_class] >= 0."""
        width = self.vocab_size if width is None else int(width)
        s = state.node[0]
        if self.bits is not None:
            words = jnp.take(self.bits, jnp.maximum(s, 0), axis=0)  # [R, W]
            shifts = jnp.arange(32, dtype=jnp.uint32)
            mask = ((words[:, :, None] >> shifts) & 1).astype(bool).reshape(s.shape[0], -1)  # [R, 32 W]
            mask = mask[:, :self.vocab_size]
        else:
            mask = jnp.take(jnp.take(self.next, jnp.maximum(s, 0), axis=0), self.token_class, axis=1) >= 0  # [R, V]
        mask = mask & (s >= 0)[:, None]
        if width > self.vocab_size:
            mask = jnp.pad(mask, ((0, 0), (0, width - self.vocab_size)))
        mask = mask[:, :width]
        fin = (s >= 0) & jnp.take(self.final, jnp.maximum(s, 0))
        for e in self.eos_ids:
            if e < width:
                mask = mask.at[:, e].set(fin)
        return mask

    def next_state(self, state, tokens):
        """int32[...]: the state after tokens (same shape as state); EOS and forbidden tokens give -1."""
        tokens = tokens.astype(jnp.int32)
        cls = jnp.take(self.token_class, jnp.clip(tokens, 0, self.vocab_size - 1))
        cls = jnp.where((tokens >= 0) & (tokens < self.vocab_size), cls, 0)
        nxt = self.next[jnp.maximum(state, 0), cls]
        return jnp.where(state >= 0, nxt, -1)

    def advance(self, state: AutomatonState, tokens) -> AutomatonState:
        return AutomatonState(node=(self.next_state(state.node[0], tokens),))

    def complete(self, state: AutomatonState):
        """Without EOS ids a row ends in an accepting state with no way on (prepare checks this is the
        only way to accept); with EOS ids the row ends by emitting one."""
        s = state.node[0]
        if self.eos_ids:
            return jnp.zeros(s.shape, bool)
        return (s >= 0) & jnp.take(self.final, jnp.maximum(s, 0))

    def candidates(self, state: AutomatonState, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None) -> Candidates:
        """Each row's best allowed tokens by log_softmax(logits) (the mask form of the constrained top-k
        kernel), per row (parent None), enough for an exact beam step: with EOS ids the best num_beams + E
        (a row offers at most E ending slots); without, the best num_beams that end (reach an accepting
        state, which then has no way on) and the best num_beams that do not."""
        v = logits.shape[-1]
        mask = self.allowed(state, v)
        s = state.node[0]
        if self.eos_ids:
            values, tokens = constrained_topk(logits, min(num_beams + len(self.eos_ids), v), mask=mask,
                                              impl=self.impl)
        else:
            nxt_all = self.next_state(jnp.broadcast_to(s[:, None], (s.shape[0], self.vocab_size)),
                                      jnp.arange(self.vocab_size, dtype=jnp.int32)[None, :])  # [R, V]
            ends_all = (nxt_all >= 0) & jnp.take(self.final, jnp.maximum(nxt_all, 0))
            ends_all = jnp.pad(ends_all, ((0, 0), (0, v - self.vocab_size)))
            kk = min(num_beams, v)
            va, ta = constrained_topk(logits, kk, mask=mask & ~ends_all, impl=self.impl)
            vb, tb = constrained_topk(logits, kk, mask=mask & ends_all, impl=self.impl)
            values, tokens = jnp.concatenate([va, vb], axis=1), jnp.concatenate([ta, tb], axis=1)
        ok = tokens >= 0
        ends = jnp.zeros(tokens.shape, bool)
        for e in self.eos_ids:
            ends = ends | (tokens == e)
        nxt = self.next_state(jnp.broadcast_to(s[:, None], tokens.shape), jnp.maximum(tokens, 0))
        if not self.eos_ids:
            ends = ends | ((nxt >= 0) & jnp.take(self.final, jnp.maximum(nxt, 0)))
        return Candidates(logprobs=jnp.where(ok, values, _NEG), tokens=jnp.where(ok, tokens, -1), ends=ends & ok,
                          next=(jnp.where(ok, nxt, -1),))

    def step_to(self, state: AutomatonState, next_nodes) -> AutomatonState:
        return AutomatonState(node=(next_nodes[0],))


def _flatten(c: AutomatonConstraint):
    return (c.token_class, c.next, c.final, c.initial, c.bits), (c.per_row, c.eos_ids, c.impl)


def _unflatten(aux, leaves) -> AutomatonConstraint:  # host facts are dropped: jit keys on shapes only
    return AutomatonConstraint(*leaves, *aux)


jax.tree_util.register_pytree_node(AutomatonConstraint, _flatten, _unflatten)


def intersect_constraints(c1: AutomatonConstraint, c2: AutomatonConstraint) -> AutomatonConstraint:
    """The product of two automaton constraints built on the host (`intersect_automata`), with each batch
    row's pair of patterns; protocol.intersect uses it when both constraints carry their host tables."""
    if c1.host is None or c2.host is None:
        raise ConstraintError("the product needs the constraints' host tables (build them outside jit)")
    i1, i2 = np.asarray(c1.initial).reshape(-1), np.asarray(c2.initial).reshape(-1)
    n = max(i1.size, i2.size)
    if {i1.size, i2.size} - {1, n}:
        raise ConstraintError(f"the constraints have start states for {i1.size} and {i2.size} rows; give both "
                              "the same rows")
    i1, i2 = np.broadcast_to(i1, (n,)), np.broadcast_to(i2, (n,))
    pat1 = {int(s): k for k, s in enumerate(c1.host.initial)}
    pat2 = {int(s): k for k, s in enumerate(c2.host.initial)}
    rows = [(pat1[int(x)], pat2[int(y)]) for x, y in zip(i1, i2)]
    distinct = list(dict.fromkeys(rows))
    prod = intersect_automata(c1.host, c2.host, pairs=distinct)
    per_row = c1.per_row or c2.per_row
    out = prod.constraint(starts=[distinct.index(r) for r in rows] if per_row else None, impl=c1.impl)
    return out.replace(eos_ids=c1.eos_ids)


def filter_index(index, automaton: TokenAutomaton, pattern: int = 0):
    """The TrieIndex of the items of `index` whose text `automaton` (pattern `pattern`) accepts: the exact
    intersection of an item set and a regex / JSON schema (an item set is finite, so the items are
    walked on the host). Prefer it to intersect(trie constraint, automaton constraint), whose rows can
    reach a prefix both allow but no item completes. Item sets keep their ids; a set left empty is
    dropped (an AutomatonError when no item is left at all)."""
    from jaxdecode.constraints.index import build_index

    if index.vocab_size > automaton.vocab_size:
        raise AutomatonError(f"the index allows token ids up to {index.vocab_size - 1} but the automaton covers "
                             f"{automaton.vocab_size}; compile it with vocab_size={index.vocab_size}")
    tokens, lengths, set_ids = index.items()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    state = np.full(lengths.shape, int(automaton.initial[pattern]), np.int64)
    for d in range(int(lengths.max(initial=0))):  # every item one token further, as arrays
        on = (lengths > d) & (state >= 0)
        tok = tokens[starts[on] + d]
        state[on] = automaton.next[state[on], automaton.token_class[tok]]
    keep = (state >= 0) & automaton.final[np.maximum(state, 0)]
    if not keep.any():
        raise AutomatonError(f"no item of the index matches {automaton.patterns[pattern]!r} (an empty "
                             "intersection)")
    items = [tokens[a:a + n].tolist() for a, n, k in zip(starts, lengths, keep) if k]
    return build_index(items, index.vocab_size, set_ids=set_ids[keep], num_sets=index.num_sets)
