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
with a slot pattern has no cheap exact form on the device, so the grammar form keeps a WITNESS instead
(LAVE's lookahead, kept from forward to forward): per row, the automaton's state after the committed
prefix (slots 0..k-1; k is the frontier, the first masked slot) and tokens for the masked slots between
k and the last committed slot such that the committed slots with that filling are a walk of the
automaton (a prefix of a text of the grammar). Each forward:
  - a guide walk runs from the frontier to the row's end: each masked slot on the way takes its witness
    token while that is allowed (left of the last committed slot), else this forward's most likely
    allowed non-EOS token (the model's own guess fills the gap; LAVE's lookahead), each committed slot
    must be allowed where the walk reaches it; every masked slot the walk reaches is masked to the tokens
    allowed there (EOS where the state accepts). The rule thus sees constrained logits at every slot
    along one plausible continuation, so a confident proposal anywhere is usually one the grammar
    allows after the guesses before it; slots past a failed walk keep their logits;
  - the rule's proposals are checked by the same walk through them (the proposed tokens fixed): all of
    them pass at once, or, for the rows where that walk fails, they are tried one at a time left to
    right, each with those kept so far. A walk that passes is a proof that the answer stays
    extendable and becomes the row's witness; one that fails is no disproof (a different filling might
    exist), so the check is a sound under-approximation and a rejected proposal is proposed again later;
  - a row that keeps no proposal commits its frontier slot: the witness's token there when something is
    committed further right, else the best allowed token. So every live row commits at least one slot
    per forward and the loop ends; the carry then walks the committed run from the frontier.
A walk costs one `allowed` + `advance` per slot from the frontier (two walks per forward, more when
proposals are tried one at a time), small beside a forward of the model.
Guarantee: the committed slots always have a witness, a row that ends with EOS is a text the grammar
accepts. Like autoregressive grammar decoding, a row may run out of answer slots before the grammar
accepts; it then ends without EOS and is no match (stats "constraint_unmatched"; a row that ran out
exactly where the grammar accepts is a match).
Infilling (a suffix) under a grammar: the witness is then a whole answer (its text to an EOS, or every
slot) that the row's suffix closes. Every walk goes to the row's last slot; EOS is allowed where the
suffix, walked from there, ends where the grammar accepts (so the guide shows the rule where the
answer may end), and a walk passes when its text is closed that way. The rule's proposals are checked
by two walks, one filling the gaps with the witness's tokens while they are allowed, one with the
model's guesses right of the last committed slot; either passing keeps them. A row that keeps nothing
commits the witness's token at the frontier. The first
witness is the emptiness check of infilling (Mündler et al.): a host search before the decode
(grammar_infill_witness: breadth first over the automaton's configurations, deduplicated per length,
for the fewest tokens the suffix closes; exact for the device form's bounded-depth language unless a
length holds more than max_configs configurations), so rows with no answer of their length are an
error before decoding, and the decode is not traceable under the user's jit (a regex / JSON-schema
constraint is). Rows finish as full matches.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.diffusion_rules import DiffusionError
from jaxdecode.sampling import first_argmax

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
        # Its device tables are built from host arrays: build them eagerly, so a TokenAutomaton closed over
        # by a caller's jax.jit gives concrete tables (read on the host below), not tracers of that trace.
        with jax.ensure_compile_time_eval():
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
        with jax.ensure_compile_time_eval():  # concrete tables inside a caller's jit (see bind)
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
    if isinstance(bound, GrammarInfill):  # the first witness was found on the host: no row is empty
        binding = GrammarBinding(constraint=bound.constraint, suffix=suffix, mask_id=mask_id, eos_ids=eos_ids,
                                 vocab_size=vocab_size)
        carry = binding.init(answer.shape[0], answer.shape[1], prompt, witness=bound.witness)
        return binding, carry, jnp.zeros((answer.shape[0],), bool)
    binding = GrammarBinding(constraint=bound, mask_id=mask_id, eos_ids=eos_ids, vocab_size=vocab_size)
    carry = binding.init(answer.shape[0], answer.shape[1], prompt)
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


# ----------------------------------------------------------------------------- grammar infilling
def suffix_closes(c, state, suffix_tokens, suffix_lengths):
    """bool[R]: from each grammar state, the row's suffix (its first suffix_lengths tokens) is allowed token
    by token and the grammar accepts after it. state: GrammarState [R]; suffix_tokens int32[R, S]."""
    r = suffix_tokens.shape[0]
    cols = jnp.arange(suffix_tokens.shape[1], dtype=jnp.int32)

    def step(x, col):
        st, ok = x
        tok = jnp.take_along_axis(suffix_tokens, jnp.full((r, 1), col), axis=1)[:, 0]
        on = col < suffix_lengths
        ok = ok & (~on | c.allowed(st)[jnp.arange(r), jnp.clip(tok, 0, c.vocab_size - 1)])
        return (_select(on, c.advance(st, tok), st), ok), None

    (state, ok), _ = jax.lax.scan(step, (state, jnp.ones((r,), bool)), cols)
    return ok & c.accepting(state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarInfill:
    """A grammar constraint bound for infilling: the constraint and each row's first witness (a whole
    answer that the suffix closes: grammar_infill_witness)."""
    constraint: object
    witness: jax.Array  # int32[B, A]


def _config_key(q, depth, stack) -> bytes:
    """A configuration's identity (the stack entries above its depth are no part of it), as the search's
    per-level keys are laid out: int32 (q, depth, stack...)."""
    stack = np.where(np.arange(stack.shape[-1]) < depth, stack, 0)
    return np.concatenate([np.asarray([q, depth]), stack]).astype(np.int32).tobytes()


def _bucket(n: int) -> int:
    return max(8, 1 << (max(n, 1) - 1).bit_length())


@jax.jit
def _expand(c, q, depth, stack, tokens):
    """Configurations after one token each: (q, depth, stack) int32[N], int32[N], int32[N, D]."""
    from jaxdecode.constraints.grammar import GrammarState
    return c.advance(GrammarState(q=q, depth=depth, stack=stack), tokens)


@jax.jit
def _allowed_closes(c, q, depth, stack, suffix_tokens, suffix_lengths):
    from jaxdecode.constraints.grammar import GrammarState
    st = GrammarState(q=q, depth=depth, stack=stack)
    return c.allowed(st), suffix_closes(c, st, suffix_tokens, suffix_lengths)


def grammar_infill_witness(constraint, start, suffix, answer_lengths, *, answer_length: int, eos_ids: tuple,
                           mask_id: int, max_configs: int = 4096, chunk: int = 1 << 15):
    """The emptiness check of infilling under a grammar, on the host: per row, a breadth-first search over
    the pushdown automaton's configurations (state, stack) reached by 0, 1, 2, ... text tokens from the
    row's start configuration, for the fewest tokens w (at most the row's answer length) after which the
    row's suffix is allowed and the grammar accepts: the answer w + EOS (+ padding), or w filling every
    slot. Configurations are deduplicated per level, so the search is exact (it decides emptiness for the
    device form's bounded-depth language) unless a level holds more than max_configs of them; then the
    shallowest stacks are kept and a row not found is "unknown". Returns (witness int32[B, A] with the
    answers found, status: a list per row of "found" / "empty" / "unknown").
    start: the rows' start GrammarState [B] (after the constraint prefix); suffix: (int32[B, S], int32[B])."""
    from jaxdecode.autoregressive import is_eos
    c = constraint
    q0, d0, s0 = (np.asarray(x) for x in (start.q, start.depth, start.stack))
    st_tok, st_len = (np.asarray(x) for x in suffix)
    lengths = np.asarray(answer_lengths)
    b, dmax = s0.shape
    pad = eos_ids[0] if eos_ids else 0
    witness = np.full((b, answer_length), pad, np.int32)
    status = []
    text = ~np.asarray(is_eos(jnp.arange(c.vocab_size, dtype=jnp.int32), eos_ids))
    if mask_id < c.vocab_size:
        text[mask_id] = False  # a witness is text: never MASK
    for r in range(b):
        q, d, stk = q0[r:r + 1], d0[r:r + 1], s0[r:r + 1]
        parents = []  # per level: (parent index int[N], token int[N]) of each configuration
        # with EOS any length up to the row's works, so a configuration seen at an earlier length is not
        # expanded again (it did not close then and its successors are already queued); without EOS the
        # answer must fill exactly n slots, so only each length's own duplicates are dropped
        seen = {_config_key(q0[r], d0[r], s0[r])} if eos_ids else None
        found, truncated, n = None, False, int(lengths[r])
        for level in range(n + 1):
            if len(q) == 0:  # every configuration reachable is explored: none closes
                break
            nb = _bucket(len(q))  # padded to a power of two: few compiled shapes
            at = np.pad(np.arange(len(q)), (0, nb - len(q)))
            sfx = (np.repeat(st_tok[r:r + 1], nb, 0), np.repeat(st_len[r:r + 1], nb, 0))
            allow, closes = (np.asarray(x)[:len(q)] for x in _allowed_closes(c, q[at], d[at], stk[at], *sfx))
            # an answer shorter than the row ends with EOS (needs eos ids); a full one needs none
            if (eos_ids or level == n) and closes.any():
                found = (level, int(np.argmax(closes)))
                break
            if level == n:
                break
            pi, tok = np.nonzero(allow & text[None, :])
            if pi.size == 0:
                break
            nq, nd, ns = [], [], []
            for o in range(0, pi.size, chunk):  # chunks padded to a power of two: few compiled expansions
                sl = slice(o, o + chunk)
                m = pi[sl].size
                idx = np.pad(pi[sl], (0, _bucket(m) - m))
                tk = np.pad(tok[sl], (0, _bucket(m) - m)).astype(np.int32)
                x = _expand(c, q[idx], d[idx], stk[idx], tk)
                nq.append(np.asarray(x.q)[:m]), nd.append(np.asarray(x.depth)[:m]), ns.append(np.asarray(x.stack)[:m])
            nq, nd, ns = np.concatenate(nq), np.concatenate(nd), np.concatenate(ns)
            live = nq >= 0
            ns = np.where(np.arange(dmax)[None, :] < nd[:, None], ns, 0)  # entries above the depth: no part of it
            key = np.concatenate([nq[:, None], nd[:, None], ns], axis=1)[live]
            _, first = np.unique(key, axis=0, return_index=True)
            first = np.sort(first)
            if seen is not None:
                fresh = [bytes(key[i].tobytes()) not in seen for i in first]
                first = first[np.asarray(fresh, bool)] if len(first) else first
                seen.update(key[i].tobytes() for i in first)
            keep = np.flatnonzero(live)[first]
            if keep.size > max_configs:  # the shallowest stacks are the likeliest to be closed by the suffix
                keep = keep[np.argsort(nd[keep], kind="stable")[:max_configs]]
                truncated = True
            parents.append((pi[keep], tok[keep]))
            q, d, stk = nq[keep], nd[keep], ns[keep]
        if found is None:
            status.append("unknown" if truncated else "empty")
            continue
        level, i = found
        toks = []
        for pi, tk in reversed(parents[:level]):
            toks.append(int(tk[i]))
            i = int(pi[i])
        witness[r, :level] = toks[::-1]
        status.append("found")
    return witness, status


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
    """Per row: the grammar's state after the committed prefix, the tokens allowed right after it, and a
    witness: tokens for the masked slots between the prefix and the last committed slot that make the
    committed slots a walk of the grammar (module docstring)."""
    state: object  # the constraint's state (GrammarState), leaves [B, ...]
    mask: jax.Array  # bool[B, V]: allowed(state), the tokens the frontier slot may take
    witness: jax.Array  # int32[B, A]: a filling of the masked slots left of the last committed one


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarStep:
    k: jax.Array  # int32[B]: the frontier, the first masked slot (A: none left)
    raw: jax.Array  # [B, A, V]: this forward's logits (the gap fillings' guesses)
    guided: jax.Array  # [B, A, V]: the logits the rule saw (each walked slot masked to its allowed tokens)
    fixed: jax.Array  # bool[B, A]: slots committed before this forward (within the row's length)
    answer: jax.Array  # int32[B, A]: the answer before this forward
    fixed_last: jax.Array  # int32[B]: the last fixed slot right of the frontier (-1: none)
    lengths: jax.Array  # int32[B]: the rows' answer lengths


def _select(ok, new, old):
    """The pytree `new` where ok[B], else `old` (every leaf has a leading batch axis)."""
    return jax.tree.map(lambda n, o: jnp.where(ok.reshape(ok.shape + (1,) * (n.ndim - 1)), n, o), new, old)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarBinding:
    """A grammar constraint: committed slots stay a walk of the pushdown automaton with a witness filling
    of the masked slots between them (module docstring)."""
    constraint: object  # a prepared GrammarConstraint (a pytree; only its Constraint protocol is used)
    suffix: object = None  # infilling: (suffix_tokens int32[B, S], suffix_lengths int32[B]); None: no suffix
    mask_id: int = dataclasses.field(default=0, metadata={"static": True})
    eos_ids: tuple = dataclasses.field(default=(), metadata={"static": True})
    vocab_size: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def infill(self) -> bool:
        return self.suffix is not None

    def _carry(self, state, witness) -> GrammarCarry:
        return GrammarCarry(state=state, mask=self.constraint.allowed(state, self.vocab_size), witness=witness)

    def init(self, batch: int, answer_length: int, prompt=None, witness=None) -> GrammarCarry:
        """The start state, walked through each row's last prefix_lengths prompt tokens (prompt given);
        witness: infilling's first complete filling (grammar_infill_witness)."""
        c = self.constraint
        state = c.init(batch)
        if prompt is not None:
            toks, lens, prefix = prompt
            first = lens - prefix  # [B]: first prompt column of the constrained text

            def walk(st, x):
                tok, j = x  # [B], scalar
                return _select((j >= first) & (j < lens), c.advance(st, tok), st), None

            state, _ = jax.lax.scan(walk, state, (toks.T, jnp.arange(toks.shape[1])))
        if witness is None:
            witness = jnp.full((batch, answer_length), self.mask_id, jnp.int32)
        return self._carry(state, jnp.asarray(witness, jnp.int32))

    def frontier(self, answer, answer_lengths):
        """int32[B]: each row's first masked slot (A when none is left)."""
        a = answer.shape[1]
        pos = jnp.arange(a, dtype=jnp.int32)[None, :]
        return jnp.min(jnp.where((answer == self.mask_id) & (pos < answer_lengths[:, None]), pos, a), axis=-1)

    def mask(self, carry: GrammarCarry, answer, answer_lengths, logits):
        """Every slot the guide walk reaches (from the frontier along the witness / the model's guesses,
        to the row's end) masked to the tokens allowed there; slots past a failed walk unchanged."""
        a = answer.shape[1]
        pos = jnp.arange(a, dtype=jnp.int32)[None, :]
        k = self.frontier(answer, answer_lengths)
        fixed = (answer != self.mask_id) & (pos < answer_lengths[:, None])  # past the length: padding
        fixed_last = jnp.max(jnp.where(fixed & (pos > k[:, None]), pos, -1), axis=-1)
        step = GrammarStep(k=k, raw=logits, guided=logits, fixed=fixed, answer=answer, fixed_last=fixed_last,
                           lengths=answer_lengths)
        _, _, guided = self._walk(carry, step, fixed, answer, answer_lengths - 1, guide=True)
        return guided, dataclasses.replace(step, guided=guided)

    def _walk(self, carry: GrammarCarry, step: GrammarStep, fixed, toks, last, guide: bool = False,
              witness_all: bool = False):
        """One left-to-right walk of the automaton from the frontier state to slot last[b]: a fixed slot's
        token must be allowed in the state reached; a masked slot takes its witness token while that is
        allowed (left of the last slot committed before this forward; everywhere with witness_all), else
        this forward's most likely allowed token (LAVE's lookahead: the model's own guess fills the gap;
        EOS only under infilling, where the suffix closes the text); past an EOS only padding. A walk that
        reaches last[b] (infilling: and whose text the suffix closes) is a proof that the fixed slots are
        a prefix of a text of the grammar (infilling: of an answer); a failed one is no disproof (another
        filling might exist): a sound under-approximation. fixed bool[B, A], toks int32[B, A], last
        int32[B] -> (ok bool[B], the filling int32[B, A] at the masked slots walked, and with guide=True
        the logits with each walked masked slot masked to the tokens allowed there)."""
        from jaxdecode.autoregressive import is_eos
        c = self.constraint
        b, a = fixed.shape
        rows, pos = jnp.arange(b), jnp.arange(a, dtype=jnp.int32)[None, :]
        eos_v = is_eos(jnp.arange(self.vocab_size, dtype=jnp.int32), self.eos_ids)  # bool[V]
        neg = jnp.asarray(_NEG, step.raw.dtype)
        allowed = lambda m, t: m[rows, jnp.clip(t, 0, self.vocab_size - 1)]  # bool[B]: token t[b] in m[b]

        def cond(x):
            i, ok, ended = x[:3]
            return (i < a) & jnp.any(ok & ~ended & (step.k + i <= last))

        def body(x):
            i, ok, ended, cur, fill, guided = x
            j = step.k + i
            jc = jnp.minimum(j, a - 1)
            active = ok & ~ended & (j <= last)
            isf = fixed[rows, jc]
            if self.infill:  # EOS (the answer ends here) where the row's suffix closes the text
                closes = suffix_closes(c, cur.state, *self.suffix)
                here = jnp.where(eos_v[None, :], closes[:, None], cur.mask)  # bool[B, V]
                fillable = here
            else:  # EOS where the grammar accepts; gaps (text continues after them) take text tokens only
                here = cur.mask
                fillable = here & ~eos_v[None, :]
            raw_j = step.raw[rows, jc]  # [B, V]
            wit = carry.witness[rows, jc]
            use_wit = ((j < step.fixed_last) | witness_all) & allowed(fillable, wit)
            guess = first_argmax(jnp.where(fillable, raw_j, neg))
            t = jnp.where(isf, toks[rows, jc], jnp.where(use_wit, wit, guess))
            good = jnp.where(isf, allowed(here, t), jnp.any(fillable, axis=-1))
            if guide:  # the rule sees each walked masked slot's allowed tokens only
                upd = (active & ~isf)[:, None]
                guided = guided.at[rows, jc].set(jnp.where(upd & ~here, neg, guided[rows, jc]))
            on = active & good & ~is_eos(t, self.eos_ids)
            cur = _select(on, self._carry(c.advance(cur.state, t), cur.witness), cur)
            fill = jnp.where((pos == j[:, None]) & (active & ~isf)[:, None], t[:, None], fill)
            ended = ended | (active & good & is_eos(t, self.eos_ids))
            return i + 1, ok & (~active | good), ended, cur, fill, guided

        init = (jnp.int32(0), jnp.ones((b,), bool), jnp.zeros((b,), bool), carry, carry.witness, step.raw)
        _, ok, ended, end, fill, guided = jax.lax.while_loop(cond, body, init)
        if self.infill:  # the answer's text (to its EOS or its last slot) must be closed by the row's suffix
            ok = ok & suffix_closes(c, end.state, *self.suffix)
        # past an EOS the fixed slots must be padding (EOS): text after the end would be dropped
        after = ended[:, None] & fixed & ~is_eos(toks, self.eos_ids)
        first_eos = jnp.min(jnp.where(fixed & is_eos(toks, self.eos_ids) & (pos >= step.k[:, None]), pos, a), axis=-1)
        ok = ok & ~jnp.any(after & (pos > first_eos[:, None]) & (pos <= last[:, None]), axis=-1)
        return ok, fill, guided

    def keep(self, carry: GrammarCarry, step: GrammarStep, commit, tokens):
        """The rule's proposals kept while a filling of the gaps left between the committed slots exists:
        first all of them in one walk; for rows where that fails, one at a time left to right (each walk
        with the ones kept so far). A row that keeps none commits its frontier slot from the witness (the
        best allowed token when nothing is committed ahead), so every live row commits at least one slot.
        The carry then moves past the committed run from the frontier."""
        from jaxdecode.autoregressive import is_eos
        b, a = commit.shape
        k = step.k
        rows, pos = jnp.arange(b), jnp.arange(a, dtype=jnp.int32)[None, :]
        live = k < a
        props = commit & ~step.fixed & live[:, None]
        base = jnp.where(step.fixed, step.answer, tokens)  # proposals' tokens at their slots

        def walk(fixed):  # to each row's last fixed slot ahead of the frontier (infilling: its last slot)
            if not self.infill:
                last = jnp.max(jnp.where(fixed & (pos >= k[:, None]), pos, -1), axis=-1)
                return self._walk(carry, step, fixed, base, last)[:2]
            # infilling: gaps filled by the model's guesses past the committed slots, or by the witness
            ok1, fill1, _ = self._walk(carry, step, fixed, base, step.lengths - 1)
            ok2, fill2, _ = self._walk(carry, step, fixed, base, step.lengths - 1, witness_all=True)
            return ok1 | ok2, jnp.where(ok1[:, None], fill1, fill2)

        ok_all, fill_all = walk(step.fixed | props)
        kept = props & ok_all[:, None]
        witness = jnp.where(ok_all[:, None], fill_all, carry.witness)
        rank = jnp.cumsum(props, axis=-1) - 1  # [B, A]: each proposal's order from the left
        count = jnp.sum(props, axis=-1)
        todo = ~ok_all & (count >= 2)  # one proposal: the walk above already tried it alone

        def cond(x):
            p, _, _ = x
            return jnp.any(todo & (p < count))

        def body(x):
            p, kept, witness = x
            this = props & (rank == p) & todo[:, None]
            ok, fill = walk(step.fixed | kept | this)
            ok = ok & jnp.any(this, axis=-1)
            return p + 1, jnp.where(ok[:, None], kept | this, kept), jnp.where(ok[:, None], fill, witness)

        _, kept, witness = jax.lax.while_loop(cond, body, (jnp.int32(0), kept, witness))

        # no proposal kept: the frontier slot from the witness (valid: the committed slots are unchanged)
        ahead = (step.fixed_last >= 0) | self.infill  # infilling: the witness is always a whole answer
        kc = jnp.minimum(k, a - 1)
        best_k = first_argmax(step.guided[rows, kc])  # slot k: masked to allowed
        t_k = jnp.where(ahead, carry.witness[rows, kc], best_k)
        fall = live & ~jnp.any(kept, axis=-1)
        at_k = pos == k[:, None]
        kept = kept | (at_k & fall[:, None])
        tokens = jnp.where(at_k & fall[:, None], t_k[:, None], base)

        # the carry walks the run of committed slots from the frontier (all valid: checked above)
        now = step.fixed | kept
        c = self.constraint

        def run_cond(x):
            i, go, _ = x
            return jnp.any(go) & (i < a)

        def run_body(x):
            i, go, cur = x
            j = k + i
            jc = jnp.minimum(j, a - 1)
            t = tokens[rows, jc]
            on = go & (j < a) & now[rows, jc] & ~is_eos(t, self.eos_ids)
            cur = _select(on, self._carry(c.advance(cur.state, t), cur.witness), cur)
            return i + 1, on, cur

        _, _, cur = jax.lax.while_loop(run_cond, run_body, (jnp.int32(0), live, carry))
        return kept, tokens, self._carry(cur.state, witness)

    def matched(self, carry: GrammarCarry, done, ends_with_eos):
        """A finished row ended with EOS, or ran out of slots where the grammar accepts (EOS allowed next);
        infilling: every finished row (its last walk went through the suffix)."""
        if self.infill:
            return done
        accepts = jnp.any(carry.mask[:, jnp.asarray(self.eos_ids, jnp.int32)], axis=-1)
        return done & (ends_with_eos | accepts)
