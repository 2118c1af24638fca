"""Regex / JSON-schema constraints in masked-diffusion decoding (jaxdecode.diffusion, `constraint=`).

A diffusion step proposes tokens at several masked slots at once, anywhere in the answer, so the
left-to-right walk of an automaton (what autoregressive decoding does) does not apply. Instead every
commit keeps the answer *completable*: the answer, read as a pattern of slots (a committed token, a
MASK = any one token, or padding past the row's length), followed by the fixed suffix of infilling,
must still have at least one filling in the automaton's language. That is the emptiness check of
Mündler et al. 2025 ("Constrained Decoding of Diffusion LLMs with Context-Free Grammars": constrained
decoding = additive infilling = is L intersected with the partial output's regular language
non-empty?), exact here because L is a DFA and every MASK is exactly one token; LAVE (Zhang et al.
2026, lookahead-then-verify) makes the same promise by sampling complete candidates instead.

Slot semantics (as the decoder's frame has them): the text is the answer up to its first EOS, then
the suffix; slots after an EOS are padding (the EOS id). So the automaton gets one extra state, D =
"the answer ended": EOS moves state s to D when s accepts the rest (the suffix walked from s ends in a
final state; no suffix: s is final), D takes only EOS / padding, and D accepts. A MASK may become any
token of any allowed class or an EOS; slots past the row's answer length are skipped.

Per forward and row (states S, classes C, one-step edges E = distinct (s, s') pairs, transitions T =
allowed (s, c) entries of next; E <= T <= S C, and T is ~10% of S C for JSON schemas):
  forward sets  F[j] bool[S+1]  states the committed pattern can be in before slot j     (scan, O(A E))
  backward sets G[j] bool[S+1]  states from which slots j.. (and the suffix) can accept  (scan, O(A E))
  feasible      bool[A, C+1]    class c at masked slot j keeps the answer completable:
                                any over transitions (s, c, s') of F[j][s] & G[j+1][s']  (O(A T))
The rule sees logits masked to the feasible tokens of each masked slot (so its confidences are those of
the constrained distribution); its commits are then filtered left to right: a scan carries the states
reachable with the commits accepted so far and accepts a proposal when some of them reaches G[j+1]
through it (G is that of the answer before this step's commits, which every accepted prefix of commits
keeps completable). The leftmost proposal always passes (its token is feasible), so the loop still
commits at least one slot per forward and ends after at most A forwards; when it ends every row's
answer (+ suffix) is in the language. Rows cut off by max_forwards keep MASK slots (stats
"unfinished"); what they committed is still completable, but the output is not a match.

Grammars (a GrammarConstraint: the bounded-depth pushdown automaton of jaxdecode.constraints.grammar;
its host fallback, llguidance's matcher, is refused). Emptiness of a context-free language intersected
with a slot pattern has no cheap exact form on the device, so the grammar form keeps the answer a PREFIX:
slots 0..k-1 committed, k.. MASK, and the automaton's state after the prefix (q, stack, depth) carried
per row from forward to forward with the mask `allowed(state)` of slot k. Each forward the logits of
slot k are masked to the allowed tokens (EOS where the state accepts), so the rule's confidence there
is the constrained one; slots right of k keep their raw logits (their proposals are only candidates: a
disallowed one is simply not kept). The rule's commits are then kept left to right: slot k always (the
rule's token when it chose k and the token is allowed, else slot k's best allowed token: at least one
commit per forward, so the loop ends), then k+1, k+2, ... while the rule chose that slot and its token
is allowed in the state after the commits kept so far (one `allowed` + `advance` per kept commit, as in
autoregressive grammar decoding); the first slot not chosen or not allowed ends the run and every
commit right of it is dropped (proposed again later). An EOS ends the row as above.
Guarantee: every committed prefix is a prefix of a text of the grammar, and a row that ends with EOS
is a text the grammar accepts. Like autoregressive grammar decoding, a row may run out of answer slots
before the grammar accepts; it then ends without EOS and is no match (stats "constraint_unmatched"; a row
that ran out exactly where the grammar accepts is a match).
No infilling (a suffix) under a grammar: that needs the emptiness check above, which is exact here only
for regular languages (use a regex / JSON-schema constraint there).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.diffusion_rules import DiffusionError

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotAutomaton:
    """A TokenAutomaton bound to one diffusion decode (a pytree; shapes give S, C, E)."""
    cls: jax.Array  # int32[V]: the model's token ids -> class; 0 = never allowed, C = an EOS id
    next: jax.Array  # int32[S, C]: next[s, c], -1 = forbidden (column 0 all -1)
    final: jax.Array  # bool[S]
    src: jax.Array  # int32[E]: one-step edges s -> s' over every class (padding: S + 1, dropped)
    dst: jax.Array  # int32[E]
    t_src: jax.Array  # int32[T]: the allowed transitions (s, class, s') of next, as lists (padding: S + 1)
    t_cls: jax.Array  # int32[T]
    t_dst: jax.Array  # int32[T]
    initial: jax.Array  # int32[B]: each row's start state

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next.shape[1])


def bind(constraint, *, vocab_size: int, eos_ids: tuple, mask_id: int, batch: int) -> SlotAutomaton:
    """Host checks and the device tables of `constraint` (an AutomatonConstraint, or a TokenAutomaton:
    pattern 0 for every row) for a decode with this model's vocabulary, EOS ids, MASK id and batch."""
    from jaxdecode.constraints.automaton import AutomatonConstraint, TokenAutomaton
    if isinstance(constraint, TokenAutomaton):
        constraint = constraint.constraint()
    if not isinstance(constraint, AutomatonConstraint):
        raise DiffusionError(f"diffusion decoding takes a regex / JSON-schema constraint (an AutomatonConstraint "
                             f"from compile_regex(...).constraint() or a TokenAutomaton) or a grammar "
                             f"(compile_grammar(...).constraint()), got {type(constraint).__name__}; other "
                             "constraints (item sets) check a text left to right only: use an autoregressive "
                             "method (greedy, sample, beam)")
    try:
        token_class, nxt, final, initial = (np.asarray(x) for x in (constraint.token_class, constraint.next,
                                                                   constraint.final, constraint.initial))
    except jax.errors.TracerArrayConversionError:
        raise DiffusionError("the constraint's tables are traced: pass the constraint to diffusion_decode from "
                             "outside jit (close over it), its tables are read on the host") from None
    v_auto, (s, c) = token_class.shape[0], nxt.shape
    if v_auto > vocab_size:
        raise DiffusionError(f"the automaton covers {v_auto} token ids but the model's vocabulary has "
                             f"{vocab_size}; compile it with this model's tokenizer (vocab_size={vocab_size})")
    for what, ids in (("MASK id", (mask_id,)), ("EOS id", eos_ids)):
        for i in ids:
            if i < v_auto and token_class[i] != 0:
                raise DiffusionError(f"{what} {i} is a token of the pattern; compile the automaton with the "
                                     f"dLLM's tokenizer (its MASK is a special token) and eos_ids including "
                                     f"the EOS ids {tuple(eos_ids)}")
    if constraint.per_row and initial.shape[0] != batch:
        raise DiffusionError(f"the constraint has start states for {initial.shape[0]} rows but the batch has "
                             f"{batch}; pass one pattern per prompt")
    cls = np.zeros(vocab_size, np.int32)
    cls[:v_auto] = token_class
    cls[list(eos_ids)] = c  # the EOS class, one past the table
    ss, cc = np.nonzero(nxt >= 0)
    tt = nxt[ss, cc]
    pairs = np.unique(ss.astype(np.int64) * s + tt)
    src, dst = (pairs // s).astype(np.int32), (pairs % s).astype(np.int32)
    if src.size == 0:  # no transitions at all: one dropped edge keeps the shapes non-empty
        src = dst = ss = tt = np.full(1, s + 1, np.int32)
        cc = np.zeros(1, np.int32)
    init = np.broadcast_to(initial.astype(np.int32), (batch,))
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return SlotAutomaton(cls=i32(cls), next=i32(nxt), final=jnp.asarray(final, bool), src=i32(src), dst=i32(dst),
                         t_src=i32(ss), t_cls=i32(cc), t_dst=i32(tt), initial=i32(init))


def bind_constraint(constraint, *, vocab_size: int, eos_ids: tuple, mask_id: int, batch: int, answer_length: int,
                    prompt_width: int = 0):
    """What one decode runs on: a SlotAutomaton for a regex / JSON-schema constraint, or the device grammar
    constraint prepared for this model (a GrammarConstraint; the llguidance fallback is refused)."""
    from jaxdecode.constraints.grammar import CompiledGrammar, GrammarConstraint, LLGuidanceConstraint
    if isinstance(constraint, CompiledGrammar):
        constraint = constraint.constraint()
    if isinstance(constraint, LLGuidanceConstraint):
        raise DiffusionError("this grammar runs on llguidance's host matcher (its compile_grammar(...).backend is "
                             "'llguidance', .reason says why), which the diffusion decoders do not drive (a host "
                             "call per kept commit inside the loop); use a grammar the device form holds (LL(1) "
                             "over bytes, no left recursion, nesting within max_depth), a regex / JSON-schema "
                             "constraint, or an autoregressive method (greedy, sample, beam)")
    if not isinstance(constraint, GrammarConstraint):
        return bind(constraint, vocab_size=vocab_size, eos_ids=eos_ids, mask_id=mask_id, batch=batch)
    from jaxdecode.constraints.trie import ConstraintError
    try:  # vocabulary, EOS ids (required: a grammar's text ends with EOS), per-row start states
        constraint = constraint.prepare(vocab_size, eos_ids, answer_length + prompt_width, batch)
    except ConstraintError as e:
        raise DiffusionError(str(e)) from None
    tok_len = getattr(getattr(constraint, "host", None), "tok_len", None)
    if tok_len is not None and mask_id < len(tok_len) and int(tok_len[mask_id]) > 0:
        raise DiffusionError(f"MASK id {mask_id} is a text token of the grammar; compile the grammar with the "
                             "dLLM's tokenizer (its MASK is a special token)")
    return constraint


def start(bound, answer, answer_lengths, suffix, prompt, *, mask_id: int, eos_ids: tuple, vocab_size: int):
    """(binding, carry, empty bool[B]) at the start of a decode: the binding's functions run each forward,
    the carry is its per-row loop state, empty marks rows no answer can satisfy. prompt: None or
    (prompt_tokens, prompt_lengths, prefix_lengths) when the constrained text starts in the prompt."""
    if isinstance(bound, SlotAutomaton):
        auto = bound if prompt is None else with_prefix(bound, *prompt)
        binding = RegexBinding(auto=auto, tacc=tail_accept(auto, suffix, answer.shape[0]), mask_id=mask_id,
                               has_eos=bool(eos_ids))
        return binding, (), ~completable(auto, binding.sets(answer, answer_lengths))
    binding = GrammarBinding(constraint=bound, mask_id=mask_id, eos_ids=eos_ids, vocab_size=vocab_size)
    carry = binding.init(answer.shape[0], prompt)
    return binding, carry, ~jnp.any(carry.mask, axis=-1)


def check_suffix_tokens(suffix, eos_ids: tuple):
    """A constrained text ends where the suffix ends: an EOS id inside the suffix is an error."""
    if suffix is None or not eos_ids:
        return
    toks, lens = (np.asarray(x) for x in suffix)
    valid = np.arange(toks.shape[1])[None, :] < lens[:, None]
    hit = np.argwhere(valid & np.isin(toks, list(eos_ids)))
    if hit.size:
        i, j = (int(t) for t in hit[0])
        raise DiffusionError(f"suffix {i} holds the EOS id {int(toks[i, j])} at token {j}: under a constraint the "
                             "text is answer + suffix and ends where the suffix ends; drop the EOS from the suffix")


# ----------------------------------------------------------------------------- device side
def with_prefix(a: SlotAutomaton, prompt_tokens, prompt_lengths, prefix_lengths) -> SlotAutomaton:
    """The automaton with each row's start state moved past the last prefix_lengths[b] tokens of its
    prompt (the part of the constrained text the prompt already holds); -1 where they do not fit."""
    p = prompt_tokens.shape[1]
    first = prompt_lengths - prefix_lengths  # [B]: first prompt column of the constrained text

    def walk(st, x):
        tok, j = x
        c = jnp.take(a.cls, jnp.clip(tok, 0, a.cls.shape[0] - 1))
        c = jnp.where(c >= a.num_classes, 0, c)  # an EOS inside the text: forbidden
        nx = jnp.where(st >= 0, a.next[jnp.maximum(st, 0), c], -1)
        return jnp.where((j >= first) & (j < prompt_lengths), nx, st), None

    init, _ = jax.lax.scan(walk, a.initial, (prompt_tokens.T, jnp.arange(p)))
    return dataclasses.replace(a, initial=init)


def _onehot(init, n: int):
    """bool[n]: the start state's set (empty for a dead start, -1)."""
    return jnp.zeros(n, bool).at[jnp.where(init >= 0, init, n + 1)].set(True, mode="drop")


def tail_accept(a: SlotAutomaton, suffix, batch: int):
    """bool[B, S]: states from which the row's suffix (None: nothing) walks to a final state."""
    s = a.num_states
    states = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (batch, s))
    if suffix is not None:
        toks, lens = suffix

        def walk(st, x):
            tok, j = x  # [B], scalar
            c = jnp.take(a.cls, tok)[:, None]  # [B, 1]; the suffix holds no EOS (checked)
            nx = jnp.where(st >= 0, jnp.take_along_axis(a.next[jnp.maximum(st, 0)], c[..., None], axis=-1)[..., 0],
                           -1)
            return jnp.where((j < lens)[:, None], nx, st), None

        states, _ = jax.lax.scan(walk, states, (toks.T, jnp.arange(toks.shape[1])))
    return (states >= 0) & jnp.take(a.final, jnp.maximum(states, 0))


def _kinds(a: SlotAutomaton, answer, answer_lengths, mask_id: int):
    """int32[B, A] per slot: its token's class (0..C-1; C = EOS), C + 1 = MASK (any), C + 2 = past the row."""
    c = a.num_classes
    pos = jnp.arange(answer.shape[1], dtype=jnp.int32)[None, :]
    kind = jnp.where(answer == mask_id, c + 1, jnp.take(a.cls, jnp.clip(answer, 0, a.cls.shape[0] - 1)))
    return jnp.where(pos < answer_lengths[:, None], kind, c + 2)


def _get(x, idx):
    return x.at[idx].get(mode="fill", fill_value=False)


def _forward_step(a: SlotAutomaton, r, kind, tacc, has_eos: bool):
    """bool[S+1]: the states after one slot of `kind` from the set r (index S = D, the answer ended)."""
    s, c = a.num_states, a.num_classes
    empty = jnp.zeros(s + 1, bool)
    nx = a.next[:, jnp.clip(kind, 0, c - 1)]  # [S]
    content = empty.at[jnp.where(r[:s] & (nx >= 0), nx, s + 1)].set(True, mode="drop")
    to_d = (jnp.any(r[:s] & tacc) | r[s]) if has_eos else jnp.bool_(False)
    eos = empty.at[s].set(to_d)
    wild = empty.at[jnp.where(_get(r, a.src), a.dst, s + 1)].set(True, mode="drop").at[s].set(to_d)
    return jnp.where(kind == c + 2, r, jnp.where(kind == c + 1, wild, jnp.where(kind == c, eos, content)))


def _backward_step(a: SlotAutomaton, g, kind, tacc, has_eos: bool):
    """bool[S+1]: the states before one slot of `kind` from which the set g (after it) is reachable."""
    s, c = a.num_states, a.num_classes
    nx = a.next[:, jnp.clip(kind, 0, c - 1)]
    content = jnp.concatenate([_get(g, jnp.where(nx >= 0, nx, s + 1)), jnp.zeros(1, bool)])
    if has_eos:
        eos = jnp.concatenate([tacc & g[s], g[s][None]])
    else:
        eos = jnp.zeros(s + 1, bool)
    wild = jnp.zeros(s + 1, bool).at[jnp.where(_get(g, a.dst), a.src, s + 1)].set(True, mode="drop") | eos
    return jnp.where(kind == c + 2, g, jnp.where(kind == c + 1, wild, jnp.where(kind == c, eos, content)))


def _row_sets(a: SlotAutomaton, kinds, init, tacc, has_eos: bool):
    """One row: (F bool[A+1, S+1] states before each slot, G bool[A+1, S+1] states that can still accept
    from each slot)."""
    s = a.num_states
    f0 = _onehot(init, s + 1)

    def fwd(r, k):
        r2 = _forward_step(a, r, k, tacc, has_eos)
        return r2, r2

    _, fs = jax.lax.scan(fwd, f0, kinds)
    g_end = jnp.concatenate([tacc, jnp.ones(1, bool) if has_eos else jnp.zeros(1, bool)])

    def bwd(g, k):
        g2 = _backward_step(a, g, k, tacc, has_eos)
        return g2, g2

    _, gs = jax.lax.scan(bwd, g_end, kinds, reverse=True)
    return jnp.concatenate([f0[None], fs]), jnp.concatenate([gs, g_end[None]])


@dataclasses.dataclass(frozen=True)
class Sets:
    """One step's reachability, per row: kinds int32[B, A], F / G bool[B, A+1, S+1]."""
    kinds: jax.Array
    f: jax.Array
    g: jax.Array


jax.tree_util.register_dataclass(Sets, data_fields=["kinds", "f", "g"], meta_fields=[])


def sets(a: SlotAutomaton, answer, answer_lengths, tacc, mask_id: int, has_eos: bool) -> Sets:
    kinds = _kinds(a, answer, answer_lengths, mask_id)
    f, g = jax.vmap(lambda k, i, t: _row_sets(a, k, i, t, has_eos))(kinds, a.initial, tacc)
    return Sets(kinds=kinds, f=f, g=g)


def completable(a: SlotAutomaton, st: Sets):
    """bool[B]: the row's pattern (+ suffix) still has a filling in the language."""
    return jnp.any(st.g[:, 0] & jax.vmap(lambda i: _onehot(i, st.g.shape[-1]))(a.initial), axis=-1)


def token_mask(a: SlotAutomaton, st: Sets, tacc, has_eos: bool):
    """bool[B, A, V]: tokens each slot may take keeping the row completable (computed for every slot;
    meaningful at masked ones)."""
    s, c = a.num_states, a.num_classes
    f, g = st.f[:, :-1], st.g[:, 1:]  # [B, A, S+1]: before slot j, after slot j

    def slot(fj, gj):  # one slot's feasible classes bool[C]: a scatter over the T transitions
        hit = _get(fj, a.t_src) & _get(gj, a.t_dst)  # [T]
        return jnp.zeros(c, bool).at[jnp.where(hit, a.t_cls, c + 1)].set(True, mode="drop")

    feas = jax.vmap(jax.vmap(slot))(f, g)  # [B, A, C]
    if has_eos:
        eos = (jnp.any(f[..., :s] & tacc[:, None, :], axis=-1) | f[..., s]) & g[..., s]
    else:
        eos = jnp.zeros(feas.shape[:2], bool)
    feas = jnp.concatenate([feas, eos[..., None]], axis=-1)  # [B, A, C+1]
    return jnp.take(feas, a.cls, axis=-1)  # [B, A, V]


def mask_logits(a: SlotAutomaton, st: Sets, logits, tacc, has_eos: bool):
    """logits [B, A, V] with the tokens that would make the answer uncompletable at -1e30 (masked slots)."""
    c = a.num_classes
    ok = token_mask(a, st, tacc, has_eos)
    masked = (st.kinds == c + 1)[..., None]
    return jnp.where(masked & ~ok, jnp.asarray(_NEG, logits.dtype), logits)


def filter_commits(a: SlotAutomaton, st: Sets, commit, tokens, tacc, has_eos: bool):
    """bool[B, A]: the commits kept, left to right: a proposal is kept when the states reachable with
    the commits kept before it still reach G (the pre-step completion sets) through its token."""
    kinds_new = jnp.take(a.cls, jnp.clip(tokens, 0, a.cls.shape[0] - 1))  # [B, A]

    def row(kinds, knew, prop, g, init, t):
        r0 = _onehot(init, a.num_states + 1)

        def body(r, x):
            k, kn, p, gj1 = x
            r_new = _forward_step(a, r, kn, t, has_eos)
            ok = p & jnp.any(r_new & gj1)
            r_old = _forward_step(a, r, k, t, has_eos)
            return jnp.where(ok, r_new, r_old), ok

        _, kept = jax.lax.scan(body, r0, (kinds, knew, prop, g[1:]))
        return kept

    return jax.vmap(row)(st.kinds, kinds_new, commit, st.g, a.initial, tacc)


# ----------------------------------------------------------------------------- the two bindings
# The decode loop calls, per forward: binding.mask(carry, answer, answer_lengths, logits) -> (masked
# logits, step) before the rule; binding.keep(carry, step, commit, tokens) -> (commits kept, tokens to
# write, next carry) after it; and at the end binding.matched(carry, done, ends_with_eos) -> bool[B].
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RegexBinding:
    """A regex / JSON-schema automaton: exact completability of the slot pattern (no carry)."""
    auto: SlotAutomaton
    tacc: jax.Array  # bool[B, S]: states from which the row's suffix reaches a final state
    mask_id: int = dataclasses.field(metadata={"static": True})
    has_eos: bool = dataclasses.field(metadata={"static": True})

    def sets(self, answer, answer_lengths) -> Sets:
        return sets(self.auto, answer, answer_lengths, self.tacc, self.mask_id, self.has_eos)

    def mask(self, carry, answer, answer_lengths, logits):
        st = self.sets(answer, answer_lengths)
        return mask_logits(self.auto, st, logits, self.tacc, self.has_eos), st

    def keep(self, carry, st, commit, tokens):
        return filter_commits(self.auto, st, commit, tokens, self.tacc, self.has_eos), tokens, carry

    def matched(self, carry, done, ends_with_eos):
        return done  # a finished row is a full match


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarCarry:
    """Per row: the grammar's state after the committed prefix and the tokens allowed right after it."""
    state: object  # the constraint's state (GrammarState), leaves [B, ...]
    mask: jax.Array  # bool[B, V]: allowed(state), the tokens the frontier slot may take


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarStep:
    k: jax.Array  # int32[B]: the frontier, the first masked slot (A: none left)
    logits_k: jax.Array  # [B, V]: the frontier slot's masked logits


def _select(ok, new, old):
    """The pytree `new` where ok[B], else `old` (every leaf has a leading batch axis)."""
    return jax.tree.map(lambda n, o: jnp.where(ok.reshape(ok.shape + (1,) * (n.ndim - 1)), n, o), new, old)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarBinding:
    """A grammar constraint: the answer stays a prefix walked by the pushdown automaton (module docstring)."""
    constraint: object  # a prepared GrammarConstraint (a pytree; only its Constraint protocol is used)
    mask_id: int = dataclasses.field(metadata={"static": True})
    eos_ids: tuple = dataclasses.field(metadata={"static": True})
    vocab_size: int = dataclasses.field(metadata={"static": True})

    def _carry(self, state) -> GrammarCarry:
        return GrammarCarry(state=state, mask=self.constraint.allowed(state, self.vocab_size))

    def init(self, batch: int, prompt=None) -> GrammarCarry:
        """The start state, walked through each row's last prefix_lengths prompt tokens (prompt given)."""
        c = self.constraint
        state = c.init(batch)
        if prompt is not None:
            toks, lens, prefix = prompt
            first = lens - prefix  # [B]: first prompt column of the constrained text

            def walk(st, x):
                tok, j = x  # [B], scalar
                return _select((j >= first) & (j < lens), c.advance(st, tok), st), None

            state, _ = jax.lax.scan(walk, state, (toks.T, jnp.arange(toks.shape[1])))
        return self._carry(state)

    def frontier(self, answer, answer_lengths):
        """int32[B]: each row's first masked slot (A when none is left)."""
        a = answer.shape[1]
        pos = jnp.arange(a, dtype=jnp.int32)[None, :]
        return jnp.min(jnp.where((answer == self.mask_id) & (pos < answer_lengths[:, None]), pos, a), axis=-1)

    def mask(self, carry: GrammarCarry, answer, answer_lengths, logits):
        """Slot k's logits masked to the allowed tokens; the other slots' unchanged."""
        k = self.frontier(answer, answer_lengths)
        at_k = (jnp.arange(answer.shape[1])[None, :] == k[:, None])[..., None]  # [B, A, 1]
        logits = jnp.where(at_k & ~carry.mask[:, None, :], jnp.asarray(_NEG, logits.dtype), logits)
        logits_k = jnp.take_along_axis(logits, jnp.minimum(k, answer.shape[1] - 1)[:, None, None], axis=1)[:, 0]
        return logits, GrammarStep(k=k, logits_k=logits_k)

    def keep(self, carry: GrammarCarry, step: GrammarStep, commit, tokens):
        """Slot k always, then k+1, ... while the rule chose the slot and its token is allowed after the
        commits kept so far; the carry moves past every kept commit."""
        from jaxdecode.autoregressive import is_eos
        b, a = commit.shape
        c, k = self.constraint, step.k
        rows, pos = jnp.arange(b), jnp.arange(a, dtype=jnp.int32)[None, :]
        allowed = lambda m, t: m[rows, jnp.clip(t, 0, self.vocab_size - 1)]  # bool[B]: token t[b] in m[b]
        live = k < a
        kc = jnp.minimum(k, a - 1)
        tok_k = tokens[rows, kc]
        t0 = jnp.where(commit[rows, kc] & allowed(carry.mask, tok_k), tok_k,
                       jnp.argmax(step.logits_k, axis=-1).astype(tokens.dtype))
        tokens = jnp.where(pos == k[:, None], t0[:, None], tokens)

        def cond(x):
            i, go, _, _ = x
            return jnp.any(go) & (i < a)

        def body(x):  # iteration i looks at slot k + i (slot k: kept unconditionally)
            i, go, cur, kept = x
            j = k + i
            jc = jnp.minimum(j, a - 1)
            t = tokens[rows, jc]
            ok = go & (j < a) & ((i == 0) | (commit[rows, jc] & allowed(cur.mask, t)))
            cur = _select(ok, self._carry(c.advance(cur.state, t)), cur)
            return i + 1, ok & ~is_eos(t, self.eos_ids), cur, kept | ((pos == j[:, None]) & ok[:, None])

        init = (jnp.int32(0), live, carry, jnp.zeros_like(commit))
        _, _, carry, kept = jax.lax.while_loop(cond, body, init)
        return kept, tokens, carry

    def matched(self, carry: GrammarCarry, done, ends_with_eos):
        """A finished row ended with EOS, or ran out of slots where the grammar accepts (EOS allowed next)."""
        accepts = jnp.any(carry.mask[:, jnp.asarray(self.eos_ids, jnp.int32)], axis=-1)
        return done & (ends_with_eos | accepts)
