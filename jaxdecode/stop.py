"""Stop strings: a row ends when its generated text ends with one of them, decided inside the decode loop.

    c = stop_constraint(model, ["\\n\\n", "def "])          # a Constraint: every decoder takes it
    c = stop_constraint(model, stops, inner=regex_constraint)  # with regex / JSON / grammar: either ends it
    text, hit = trim_at_stop(decoded_text, stops)           # the text before the stop string

Host: the stop strings' UTF-8 bytes become an Aho-Corasick automaton over bytes with one absorbing STOP
state (every transition that completes a stop string goes there), lifted to tokens by reading each
token's bytes from every state at once (NumPy, one gather per byte position over [S, V]). Tokens whose
columns are identical share a class, as in jaxdecode.constraints.automaton:

    token_class int32[V]     special tokens and ids past the tokenizer: the identity class (no text)
    next        int32[S, C]  the state after a token of class c; state S - 1 is STOP (absorbing)

Device: a step is `next[s, token_class[t]]`, a row is complete at STOP, so the decoders end the row at
the token that completes a stop string (kept in the output, like an EOS), whether the string spans
several tokens or sits inside one. Nothing is masked (`allowed` is all-True) unless an `inner`
constraint masks; then a row ends when either the inner constraint is complete or a stop string is hit
(not IntersectConstraint's "both").

Matching is on the generated text only (the prompt's tail is not read), as in vLLM / OpenAI. Bytes
match text exactly for byte-level BPE; SentencePiece tokenizers drop a leading space when decoding,
which the automaton still sees.

Speculative decoding: a row ends inside an accepted block at the stopping token, like an EOS, and the
engine prunes draft nodes after it. Token-by-token verifiers stay lossless under that cut (a draft
length chosen from the drafted prefix; χ² in tests/test_stop.py) and greedy is exact. The verifiers
that judge the whole draft jointly (block, gbv) are refused, as with every constraint: their proofs
take the draft as given, and gbv truncates every path to the shortest, so one path's stop would cut
the others.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.trie import Candidates, ConstraintError

_NEG = float("-inf")


class StopError(ConstraintError):
    """Stop strings that cannot be used as given, with what to change."""


# ----------------------------------------------------------------------------- input
def check_stops(stops) -> tuple[str, ...]:
    """The stop strings as a tuple (one string -> a 1-tuple), in order, duplicates dropped; a StopError for
    anything else than a non-empty string or a list / tuple of non-empty strings."""
    if isinstance(stops, str):
        stops = [stops]
    elif not isinstance(stops, (list, tuple)):
        raise StopError(f"stop must be a string or a list of strings, got {type(stops).__name__}")
    if not stops:
        raise StopError("stop is an empty list: give at least one stop string, or leave stop unset")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise StopError(f"stop[{i}] must be a string, got {type(s).__name__} ({s!r})")
        if not s:
            raise StopError(f"stop[{i}] is the empty string, which every text ends with: drop it")
    return tuple(dict.fromkeys(stops))


# ----------------------------------------------------------------------------- host automaton
def byte_automaton(stops) -> np.ndarray:
    """int32[S, 256]: the Aho-Corasick automaton of the stop strings' UTF-8 bytes as a DFA. State 0 is
    the start, state S - 1 is STOP: any byte that completes a stop string (as a suffix of what was
    read) leads there, and it never leaves."""
    pats = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in stops]
    goto, out = [{}], [False]  # the trie of the patterns; out: a pattern ends here
    for p in pats:
        s = 0
        for b in p:
            if b not in goto[s]:
                goto.append({})
                out.append(False)
                goto[s][b] = len(goto) - 1
            s = goto[s][b]
        out[s] = True
    n = len(goto)
    dfa = np.zeros((n, 256), np.int32)  # the plain Aho-Corasick DFA (goto + failure links resolved)
    fail = np.zeros(n, np.int64)
    queue = collections.deque()
    for b, t in goto[0].items():
        dfa[0, b] = t
        queue.append(t)
    while queue:  # breadth first: a failure state is shallower, so its row is final before it is read
        s = queue.popleft()
        dfa[s] = dfa[fail[s]]
        for b, t in goto[s].items():
            fail[t] = dfa[fail[s], b]
            out[t] = out[t] or out[fail[t]]  # a pattern ends at t or at a suffix of its path
            dfa[s, b] = t
            queue.append(t)
    stop = n
    delta = np.full((n + 1, 256), stop, np.int32)
    delta[:n] = np.where(np.asarray(out)[dfa], stop, dfa)  # completing a pattern: STOP, for good
    return delta


def token_matrix(byte_strings, vocab_size: int):
    """(uint8[V, L] bytes padded with 0, int32[V] lengths): each id's bytes; None (special tokens) and ids
    past the list have length 0 (they add no text)."""
    lengths = np.zeros(vocab_size, np.int32)
    for i, b in enumerate(byte_strings[:vocab_size]):
        if b:
            lengths[i] = len(b)
    mat = np.zeros((vocab_size, int(lengths.max(initial=0))), np.uint8)
    for i, b in enumerate(byte_strings[:vocab_size]):
        if b:
            mat[i, :len(b)] = np.frombuffer(b, np.uint8)
    return mat, lengths


def token_table(delta: np.ndarray, mat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int32[S, V]: the state after each token's bytes from every state (a length-0 token: the state
    itself). Tokens are sorted by length so that position p steps only the tokens longer than p."""
    s, v = delta.shape[0], mat.shape[0]
    order = np.argsort(-lengths, kind="stable")
    sorted_len, sorted_mat = lengths[order], mat[order]
    cur = np.broadcast_to(np.arange(s, dtype=np.int32)[:, None], (s, v)).copy()  # [S, V] in sorted order
    for p in range(mat.shape[1]):
        k = int(np.count_nonzero(sorted_len > p))  # tokens longer than p: the first k
        cur[:, :k] = delta[cur[:, :k], sorted_mat[None, :k, p]]
    out = np.empty_like(cur)
    out[:, order] = cur
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class StopTables:
    """The token-level stop automaton on the host. See the module docstring."""
    token_class: np.ndarray  # int32[V]
    next: np.ndarray  # int32[S, C]; state S - 1 = STOP
    stops: tuple

    @property
    def stop_state(self) -> int:
        return int(self.next.shape[0]) - 1

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    def constraint(self, inner=None, *, eos_ids=(), impl: str = "auto") -> "StopConstraint":
        """The device constraint over these tables (see stop_constraint)."""
        return StopConstraint(token_class=jnp.asarray(self.token_class), next=jnp.asarray(self.next), inner=inner,
                              eos_ids=tuple(int(e) for e in eos_ids), impl=impl, stops=self.stops)

    def walk(self, tokens, state: int = 0) -> int:
        """The state after `tokens` (host; ids outside the vocabulary add no text)."""
        for t in tokens:
            t = int(t)
            if 0 <= t < self.vocab_size:
                state = int(self.next[state, self.token_class[t]])
        return state


def compile_stops(byte_strings, stops, vocab_size: int) -> StopTables:
    """StopTables for a vocabulary given as each id's bytes (None: a special token, no text)."""
    stops = check_stops(stops)
    delta = byte_automaton(stops)
    mat, lengths = token_matrix(byte_strings, vocab_size)
    full = token_table(delta, mat, lengths)  # [S, V]
    token_class, nxt = _classes(full)
    return StopTables(token_class=token_class, next=nxt, stops=stops)


def _classes(full: np.ndarray):
    """(token_class int32[V], next int32[S, C]): tokens with identical columns of full[S, V] share a class.
    Columns are grouped by a 64-bit hash, checked exactly (a collision falls back to sorting columns)."""
    from jaxdecode.constraints.automaton import _mix64
    h = np.zeros(full.shape[1], np.uint64)
    with np.errstate(over="ignore"):
        for row in full:  # S passes over [V]: a hash of the column, state by state
            h = _mix64(h * np.uint64(0x9E3779B97F4A7C15) + row.astype(np.uint64))
    _, first, cls = np.unique(h, return_index=True, return_inverse=True)
    cls = cls.reshape(-1)
    nxt = full[:, first]  # [S, C]: each class's first token's column
    if not np.array_equal(nxt[:, cls], full):  # a hash collision (never seen): the exact way
        cols, cls = np.unique(full, axis=1, return_inverse=True)
        nxt, cls = cols, cls.reshape(-1)
    return cls.astype(np.int32), np.ascontiguousarray(nxt, np.int32)


_CACHE: "collections.OrderedDict" = collections.OrderedDict()
_CACHE_SIZE = 16
_LOCK = threading.Lock()


def stop_tables(tokenizer, stops, vocab_size: int) -> StopTables:
    """compile_stops for a Hugging Face tokenizer, cached in memory per (tokenizer object, stops, V)."""
    from jaxdecode.constraints.automaton import token_bytes
    stops = check_stops(stops)
    key = (id(tokenizer), stops, int(vocab_size))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            _CACHE.move_to_end(key)
            return hit[1]
    tables = compile_stops(token_bytes(tokenizer), stops, vocab_size)
    with _LOCK:
        _CACHE[key] = (tokenizer, tables)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return tables


# ----------------------------------------------------------------------------- device constraint
@dataclasses.dataclass(frozen=True)
class StopState:
    """Per row: the stop automaton's state, and the inner constraint's state (None without one).
    node = (stop state,) + the inner state's nodes (what beam search carries)."""
    stop: jax.Array  # int32[R]
    inner: object = None

    @property
    def node(self) -> tuple:
        return (self.stop,) + (() if self.inner is None else tuple(self.inner.node))

    def replace(self, **kw) -> "StopState":
        if "node" in kw:
            node = tuple(kw.pop("node"))
            kw["stop"] = node[0]
            if self.inner is not None:
                kw["inner"] = self.inner.replace(node=node[1:])
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(StopState, data_fields=["stop", "inner"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StopConstraint:
    """The Constraint protocol (jaxdecode.constraints.protocol) for stop strings, optionally around an
    inner constraint that masks. A pytree: the tables and the inner constraint are its leaves."""
    token_class: jax.Array  # int32[V]
    next: jax.Array  # int32[S, C]; state S - 1 = STOP
    inner: object = None
    eos_ids: tuple = ()
    impl: str = "auto"
    stops: tuple = ()  # for messages; not part of the pytree

    what = "stop strings"  # named by the speculative engine's refusal of joint verifiers (block, gbv)

    def replace(self, **kw) -> "StopConstraint":
        return dataclasses.replace(self, **kw)

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    @property
    def stop_state(self) -> int:
        return int(self.next.shape[0]) - 1

    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None) -> "StopConstraint":
        if self.vocab_size != vocab_size:
            raise StopError(f"the stop-string tables cover {self.vocab_size} token ids but the model's vocabulary "
                            f"has {vocab_size}: build them with this model (stop_constraint(model, stops))")
        inner = None if self.inner is None else self.inner.prepare(vocab_size, eos_ids, max_new_tokens, batch)
        return self.replace(inner=inner, eos_ids=tuple(int(e) for e in eos_ids))

    def init(self, batch: int, beams: int = 1) -> StopState:
        return StopState(stop=jnp.zeros((batch * beams,), jnp.int32),
                         inner=None if self.inner is None else self.inner.init(batch, beams))

    def allowed(self, state: StopState, width: int | None = None):
        """The inner constraint's mask; without one every token (stop strings never forbid)."""
        width = self.vocab_size if width is None else int(width)
        if self.inner is not None:
            return self.inner.allowed(state.inner, width)
        return jnp.ones((state.stop.shape[0], width), bool)

    def next_stop(self, stop, tokens):
        """int32[...]: the stop automaton's state after tokens (ids outside the vocabulary: no text)."""
        tokens = tokens.astype(jnp.int32)
        inside = (tokens >= 0) & (tokens < self.vocab_size)
        cls = jnp.take(self.token_class, jnp.clip(tokens, 0, self.vocab_size - 1))
        return jnp.where(inside, self.next[stop, cls], stop)

    def advance(self, state: StopState, tokens) -> StopState:
        return StopState(stop=self.next_stop(state.stop, tokens),
                         inner=None if self.inner is None else self.inner.advance(state.inner, tokens))

    def hit(self, state: StopState):
        """bool[R]: a stop string was completed."""
        return state.stop == self.stop_state

    def complete(self, state: StopState):
        """A stop string was hit, or the inner constraint is complete."""
        done = self.hit(state)
        return done if self.inner is None else done | self.inner.complete(state.inner)

    def _ends_all(self, state: StopState, v: int):
        """bool[R, v]: taking the token ends the row (an EOS id, a stop string, the inner one complete)."""
        r = state.stop.shape[0]
        rows = jnp.take(self.next, state.stop, axis=0)  # [R, C]
        ends = jnp.take(rows, self.token_class, axis=1) == self.stop_state  # [R, V]
        ends = jnp.pad(ends, ((0, 0), (0, v - self.vocab_size)))[:, :v]
        eos = [e for e in self.eos_ids if e < v]
        if eos:
            ends = ends | jnp.zeros((v,), bool).at[jnp.asarray(eos)].set(True)[None, :]
        if self.inner is not None and not (self.eos_ids and _ends_only_by_eos(self.inner)):
            from jaxdecode.constraints.protocol import advance_each
            every = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (r, v))
            ends = ends | self.inner.complete(advance_each(self.inner, state.inner, every)).reshape(r, v)
        return ends

    def candidates(self, state: StopState, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None) -> Candidates:
        """Each row's best allowed tokens by log_softmax(logits), per row (parent None), enough for an
        exact beam step: the best num_beams that end the row (EOS, a stop string, the inner constraint
        complete) and the best num_beams that do not, any number of tokens being able to end it."""
        from jaxdecode.constraints.protocol import advance_each, topk_ending_and_not

        r, v = logits.shape
        ends_all = self._ends_all(state, v)
        values, tokens = topk_ending_and_not(logits, self.allowed(state, v), ends_all, num_beams, self.impl)
        ok = tokens >= 0
        k = tokens.shape[1]
        ends = jnp.take_along_axis(ends_all, jnp.maximum(tokens, 0), axis=1)
        moved = advance_each(self, state, jnp.maximum(tokens, 0))
        nxt = tuple(jnp.where(ok, n.reshape(r, k), -1) for n in moved.node)
        return Candidates(logprobs=jnp.where(ok, values, _NEG), tokens=jnp.where(ok, tokens, -1), ends=ends & ok,
                          next=nxt)

    def step_to(self, state: StopState, next_nodes) -> StopState:
        next_nodes = tuple(next_nodes)
        stop = jnp.maximum(next_nodes[0], 0)  # a beam without a candidate (-1) is dead anyway
        inner = None if self.inner is None else self.inner.step_to(state.inner, next_nodes[1:])
        return StopState(stop=stop, inner=inner)


def _ends_only_by_eos(inner) -> bool:
    """Whether the inner constraint can only end a row by an EOS id once it has EOS ids (automata: their
    `complete` is then always False), so its ends need no advance over every token."""
    from jaxdecode.constraints.automaton import AutomatonConstraint
    return isinstance(inner, AutomatonConstraint)


def _flatten(c: StopConstraint):
    return (c.token_class, c.next, c.inner), (c.eos_ids, c.impl)


def _unflatten(aux, leaves) -> StopConstraint:  # the stop strings (messages only) are dropped: jit keys on shapes
    return StopConstraint(*leaves, *aux)


jax.tree_util.register_pytree_node(StopConstraint, _flatten, _unflatten)


def stop_constraint(model, stops, inner=None, *, eos_ids=None, impl: str = "auto") -> StopConstraint:
    """The Constraint that ends each row at the token completing one of `stops` (a string or a list of
    non-empty strings, the same for every row) in its generated text. inner: a constraint that masks
    (regex / JSON schema / grammar); the row then ends when it is complete or a stop string is hit.
    eos_ids: bound now (decoders bind theirs again in prepare)."""
    stops = check_stops(stops)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise StopError("stop strings need the model's tokenizer (they are matched on the tokens' bytes); this "
                        "model has no tokenizer files: load a checkpoint with its tokenizer, or stop by eos_ids")
    if inner is not None and not all(callable(getattr(inner, m, None)) for m in
                                     ("prepare", "init", "allowed", "advance", "complete")):
        raise StopError(f"inner must be a constraint (jaxdecode.constraints), got {type(inner).__name__}")
    tables = stop_tables(tokenizer, stops, model.config.vocab_size)
    eos = tuple(model.config.eos_token_ids if eos_ids is None else (int(e) for e in eos_ids))
    return tables.constraint(inner, eos_ids=eos, impl=impl)


# ----------------------------------------------------------------------------- text
def trim_at_stop(text: str, stops) -> tuple[str, str | None]:
    """(text before the stop, the stop string) at the first place the text ends with a stop string (the
    earliest end, which is where the decode loop stopped; among stops ending there the longest), or
    (text, None) when none occurs. The stop string is not kept; the tokens keep it."""
    stops = check_stops(stops)
    best = None  # (end, -length, stop)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cand = (i + len(s), -len(s), s)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return text, None
    end, neg_len, s = best
    return text[:end + neg_len], s


def text_before_stop(decode, tokens, stops, skip_special_tokens: bool = True) -> tuple[str, str | None]:
    """(a row's text up to its first stop string, the stop) or (its whole text, None), where `decode(ids,
    skip_special_tokens=...)` is the model's. The stop is looked for where the decode loop looked for it:
    in the text without special tokens (they have no text for the stop automaton, so "im_end" inside
    "<|im_end|>" is no stop). With skip_special_tokens=False the special tokens before the stop are
    kept in the returned text; one inside the stop string goes with it."""
    plain = decode(tokens, skip_special_tokens=True)
    before, hit = trim_at_stop(plain, stops)
    if hit is None:
        return (plain if skip_special_tokens else decode(tokens, skip_special_tokens=False)), None
    if skip_special_tokens:
        return before, hit
    # The longest token prefix whose text lies wholly before the stop, then the rest of `before`.
    for j in range(len(tokens), -1, -1):
        head = decode(tokens[:j], skip_special_tokens=True)
        if before.startswith(head):
            return decode(tokens[:j], skip_special_tokens=False) + before[len(head):], hit
    return before, hit  # unreachable: the empty prefix decodes to ""


__all__ = ["StopConstraint", "StopError", "StopState", "StopTables", "check_stops", "compile_stops",
           "stop_constraint", "stop_tables", "text_before_stop", "trim_at_stop"]
