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

Token bytes. The automaton is over bytes: each id's byte string comes from the tokenizer (byte-level
BPE's printable-unicode alphabet mapped back to bytes, SentencePiece's '▁' and <0xNN> byte tokens), so
a token that spans the boundary of a literal (`":` in `{"a":1}`) or holds part of a UTF-8 character is
allowed exactly where its bytes fit the pattern.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.trie import Candidates, ConstraintError
from jaxdecode.kernels.constrained import constrained_topk

_NEG = float("-inf")
CACHE_VERSION = 1


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
@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A token-level DFA in class form, on the host (NumPy). See the module docstring."""
    token_class: np.ndarray  # int32[V]
    next: np.ndarray  # int32[S, C]; -1 = forbidden; column 0 is all -1
    final: np.ndarray  # bool[S]
    initial: np.ndarray  # int32[N]: the start state of each pattern stacked here (one for one pattern)
    patterns: tuple = ()  # what each start state constrains to (the regex), for messages

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next.shape[1])

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

    def constraint(self, starts=None, *, impl: str = "auto") -> "AutomatonConstraint":
        """The device constraint; `starts`: int[B], which stacked pattern each batch row follows (None:
        pattern 0 for every row)."""
        starts_h = None if starts is None else np.asarray(starts, np.int64).reshape(-1)
        if starts_h is not None and ((starts_h < 0) | (starts_h >= self.initial.shape[0])).any():
            bad = int(starts_h[(starts_h < 0) | (starts_h >= self.initial.shape[0])][0])
            raise ConstraintError(f"pattern index {bad} is outside [0, {self.initial.shape[0]}) (the patterns "
                                  "stacked in this automaton)")
        init = self.initial[np.zeros(1, np.int64) if starts_h is None else starts_h]
        return AutomatonConstraint(token_class=jnp.asarray(self.token_class), next=jnp.asarray(self.next),
                                   final=jnp.asarray(self.final), initial=jnp.asarray(init, jnp.int32),
                                   per_row=starts_h is not None, impl=impl, host=self)

    # ------------------------------------------------------------------ save / load
    def save(self, path) -> None:
        np.savez_compressed(path, token_class=self.token_class, next=self.next, final=self.final,
                            initial=self.initial, patterns=np.array(self.patterns, dtype=object),
                            version=np.int32(CACHE_VERSION))

    @classmethod
    def load(cls, path) -> "TokenAutomaton":
        with np.load(path, allow_pickle=True) as z:
            if int(z["version"]) != CACHE_VERSION:
                raise AutomatonError(f"{path} was written by another automaton format version")
            return cls(token_class=z["token_class"], next=z["next"], final=z["final"], initial=z["initial"],
                       patterns=tuple(str(p) for p in z["patterns"]))


def from_transitions(transitions: dict, initial: int, finals, vocab_size: int, *, pattern: str = "",
                     drop_ids=()) -> TokenAutomaton:
    """Class form of a token DFA given as {state: {token: next state}} (outlines-core's
    `Index.get_transitions()`); states are renumbered 0..S-1 in sorted order; `drop_ids` (the EOS ids)
    are left out of the table (EOS is allowed by `final`)."""
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
    full = np.full((len(states), vocab_size), -1, np.int32)  # [S, V], dense only on the host
    full[np.asarray(rows, np.int64), np.asarray(cols, np.int64)] = np.asarray(vals, np.int32)
    return _classify(full, np.asarray([num[initial]], np.int32),
                     np.isin(np.arange(len(states)), [num[f] for f in finals]), (pattern,))


def _classify(full: np.ndarray, initial, final, patterns) -> TokenAutomaton:
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
                          patterns=tuple(patterns))


# ----------------------------------------------------------------------------- compilers
def _cache_dir() -> Path:
    return Path(os.environ.get("JAXDECODE_CACHE", Path.home() / ".cache" / "jaxdecode")) / "automata"


def compile_regex(pattern: str, tokenizer, *, vocab_size: int | None = None, eos_ids=None,
                  cache: bool = True) -> TokenAutomaton:
    """Token automaton of `pattern` (matched in full) over `tokenizer`'s tokens, via outlines-core.

    vocab_size: the model's vocabulary (>= the tokenizer's; extra ids are never allowed). eos_ids: ids
    left out of the table (they end the text; default the tokenizer's EOS). Compiled automata are cached
    on disk (JAXDECODE_CACHE, default ~/.cache/jaxdecode/automata) keyed by (pattern, tokenizer bytes,
    vocab_size, eos_ids)."""
    if not isinstance(pattern, str) or not pattern:
        raise AutomatonError(f"a regex must be a non-empty string, got {pattern!r}")
    tb = token_bytes(tokenizer)
    v = max(len(tb), int(vocab_size or 0))
    if eos_ids is None:
        eos_ids = () if getattr(tokenizer, "eos_token_id", None) is None else (int(tokenizer.eos_token_id),)
    eos_ids = tuple(int(e) for e in eos_ids)
    key = hashlib.sha256(json.dumps([CACHE_VERSION, pattern, tokenizer_fingerprint(tokenizer), v,
                                     sorted(eos_ids)]).encode()).hexdigest()[:40]
    path = _cache_dir() / f"{key}.npz"
    if cache and path.exists():
        try:
            return TokenAutomaton.load(path)
        except Exception:  # a stale or partial file: rebuild it
            pass
    import outlines_core

    mapping: dict[bytes, list[int]] = {}
    for i, b in enumerate(tb):
        if b is not None and b and i not in eos_ids:
            mapping.setdefault(b, []).append(i)
    eos_for_oc = eos_ids[0] if eos_ids else v  # outlines-core wants one EOS id outside the map
    try:
        vocab = outlines_core.Vocabulary(eos_for_oc, mapping)
        index = outlines_core.Index(pattern, vocab)
    except Exception as e:  # outlines-core raises ValueError / its own errors, all with a message
        raise AutomatonError(f"cannot compile the regex {pattern!r}: {e}") from None
    auto = from_transitions(index.get_transitions(), index.get_initial_state(), index.get_final_states(), v,
                            pattern=pattern, drop_ids=(eos_for_oc,) + eos_ids)
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            auto.save(tmp)
            os.replace(tmp, path)
        except OSError:  # a read-only home: compile again next time
            pass
    return auto


def schema_to_regex(schema, *, whitespace: str | None = None) -> str:
    """outlines-core's JSON schema -> regex converter (schema: a dict, a JSON string or a file path)."""
    import outlines_core

    if isinstance(schema, (str, Path)) and not str(schema).lstrip().startswith("{") and Path(schema).exists():
        schema = Path(schema).read_text()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return outlines_core.json_schema.build_regex_from_schema(text, whitespace)
    except Exception as e:
        raise AutomatonError(f"cannot convert the JSON schema to a regex: {e}") from None


def compile_json_schema(schema, tokenizer, *, whitespace: str | None = None, **kw) -> TokenAutomaton:
    """Token automaton of the texts valid under a JSON schema (outlines-core's converter, then
    compile_regex)."""
    return compile_regex(schema_to_regex(schema, whitespace=whitespace), tokenizer, **kw)


# ----------------------------------------------------------------------------- device constraint
@dataclasses.dataclass(frozen=True)
class AutomatonState:
    state: jax.Array  # int32[R]; -1 = finished (emitted EOS) or dead


jax.tree_util.register_dataclass(AutomatonState, data_fields=["state"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class AutomatonConstraint:
    """The Constraint protocol (see jaxdecode.constraints.trie) over a TokenAutomaton. A pytree."""
    token_class: jax.Array  # int32[V]
    next: jax.Array  # int32[S, C]
    final: jax.Array  # bool[S]
    initial: jax.Array  # int32[B] (per_row) or int32[1]: start state of each batch row
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
        return AutomatonState(state=jnp.repeat(init.astype(jnp.int32), beams))

    def _rows(self, state):
        return jnp.take(self.next, jnp.maximum(state, 0), axis=0)  # [R, C]

    def allowed(self, state: AutomatonState, width: int | None = None):
        """bool[R, width]: tokens each row may emit (EOS ids exactly at accepting states)."""
        width = self.vocab_size if width is None else int(width)
        s = state.state
        mask = jnp.take(self._rows(s), self.token_class, axis=1) >= 0  # [R, V]
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
        return AutomatonState(state=self.next_state(state.state, tokens))

    def complete(self, state: AutomatonState):
        """Without EOS ids a row ends in an accepting state with no way on (prepare checks this is the
        only way to accept); with EOS ids the row ends by emitting one."""
        s = state.state
        if self.eos_ids:
            return jnp.zeros(s.shape, bool)
        return (s >= 0) & jnp.take(self.final, jnp.maximum(s, 0))

    def candidates(self, state: AutomatonState, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None) -> Candidates:
        """Each row's best num_beams + len(eos_ids) allowed tokens by log_softmax(logits) (the mask form
        of the constrained top-k kernel), per row (parent None) — exact for a beam step."""
        k = min(num_beams + len(self.eos_ids), logits.shape[-1])
        mask = self.allowed(state, logits.shape[-1])
        values, tokens = constrained_topk(logits, k, mask=mask, impl=self.impl)
        ok = tokens >= 0
        ends = jnp.zeros(tokens.shape, bool)
        for e in self.eos_ids:
            ends = ends | (tokens == e)
        nxt = self.next_state(jnp.broadcast_to(state.state[:, None], tokens.shape), jnp.maximum(tokens, 0))
        if not self.eos_ids:
            fin = (nxt >= 0) & jnp.take(self.final, jnp.maximum(nxt, 0))
            ends = ends | fin
        return Candidates(logprobs=jnp.where(ok, values, _NEG), tokens=jnp.where(ok, tokens, -1), ends=ends & ok,
                          next=(jnp.where(ok, nxt, -1),))

    def step_to(self, state: AutomatonState, next_nodes) -> AutomatonState:
        return AutomatonState(state=next_nodes[0])


def _flatten(c: AutomatonConstraint):
    return (c.token_class, c.next, c.final, c.initial), (c.per_row, c.eos_ids, c.impl)


def _unflatten(aux, leaves) -> AutomatonConstraint:  # host facts are dropped: jit keys on shapes only
    return AutomatonConstraint(*leaves, *aux)


jax.tree_util.register_pytree_node(AutomatonConstraint, _flatten, _unflatten)
