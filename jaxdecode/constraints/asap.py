"""Grammar-aligned sampling: ASAp (Park et al., "Grammar-Aligned Decoding", NeurIPS 2024; ALGORITHMS.md §6).

    out = asap_sample(model, auto.constraint(), num_samples=200, prompt_tokens=toks, prompt_lengths=lens,
                      max_new_tokens=32, eos_ids=(0,), seed=0)
    out.tokens[b, -1]          # the last sample of row b (drawn from the most corrected proposal)
    out.log_mass[b, -1]        # log of the estimated grammatical mass: an upper bound on log P(x in L)
    out.distribution(b)        # {sample: its probability under the final proposal} = p(x) / mass

Why. Masking and renormalising each step draws prod_i p(x_i | x_<i) [x_i allowed] / Z_i, where Z_i is the
allowed mass at step i; the target is p(x | x in L) = p(x) / P(L). The two differ whenever the allowed
next tokens lead to futures of different grammatical mass (a prefix the model likes to continue with a
forbidden token gets the same share as one that stays inside L easily).

The rule. With EFG(w) = P(a continuation of prefix w is in L) (expected future grammaticality), the exact
conditional draws x_i with probability p(x_i | w) * EFG(w x_i) / EFG(w). ASAp replaces EFG by an upper
bound that tightens with every sample: a trie of the prefixes sampled so far holds EFG~; a prefix never
visited has EFG~ = 1 if the constraint allows it (0 if not), so the first sample is plain masking; after
each sample, every prefix w on its path (leaf first) is updated to
    EFG~(w) = sum_y p(y | w) EFG~(w y)   (unvisited allowed children count 1, EOS counts 1 where allowed)
which lowers it by the mass of the ways out found ungrammatical: dead ends (no allowed token) and
cut-offs (max_new_tokens reached without finishing: the target is p(x | x in L, len(x) <= max_new_tokens)).
For a complete sample x every prefix is in the trie, so its probability under the proposal of the next
round is exactly p(x) / EFG~(root): `distribution` and `log_mass` give that, and as EFG~(root) falls to
P(L) the proposal converges to the exact conditional.

How it runs. ASAp is sequential over samples (each sample's proposal depends on the trie left by all
earlier ones), so the budget is `num_samples` one-sample rounds (`samples_per_round=k` draws k rows per
prompt from one proposal per round: num_samples / k rounds, the proposal lagging by up to k - 1
samples). Each round is one jit-compiled `lax.while_loop` over the new tokens (one batched forward per
step; the batch is the prompts, each with its own trie); the loop reads the trie's correction weights
from device arrays (CSR: each node's children tokens, their EFG~ and their node ids, read in a fixed
window as wide as the widest node) and records, per step, p(chosen token), the allowed mass (EOS apart)
and the allowed token count. Between rounds the host updates the trie (float64) and uploads its arrays
(capacities growing 4x, so few rounds recompile). The prompt is prefilled once; every round starts from
that KV cache.

LMs: a jaxdecode Model (or `ModelLM(config, params)`), or any jit-able prefix function
`logits_fn(tokens int32[B, T], lengths int32[B]) -> logits[B, V]` (the next-token logits after each row's
first `lengths` tokens; `PrefixFnLM`) for hand-set toy models. The sampler's temperature / top-k / top-p /
min-p define p (repetition penalty is refused: it is not a function of the prefix alone).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.kernels.common import next_pow2
from jaxdecode.sampling import SamplerConfig, process_logits

COMPLETE, CUT_OFF, DEAD_END = 0, 1, 2  # status of a sample
STATUS_NAMES = ("complete", "cut off at max_new_tokens", "dead end (no allowed token)")
_MIN_CAPACITY = 1024  # trie arrays: slots at least, growing 4x (each new size compiles the round once)
_MIN_WIDTH = 16  # children read per node at least


class AsapError(ValueError):
    """Arguments ASAp cannot run with, and what to change."""


# ----------------------------------------------------------------------------- LMs
@dataclasses.dataclass(frozen=True)
class ModelLM:
    """A jaxdecode model behind `start` / `step`: the carry is its KV cache."""
    config: object
    params: object
    cache_len: int = 0

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def start(self, prompt_tokens, prompt_lengths):
        """(carry, logits[B, V]) after each row's prompt."""
        from jaxdecode.autoregressive import prefill
        from jaxdecode.models import init_cache
        cache = init_cache(self.config, prompt_tokens.shape[0], self.cache_len)
        logits, cache = prefill(self.config, self.params, prompt_tokens, prompt_lengths, cache)
        return cache, logits

    def step(self, cache, tokens, live):
        """Feed tokens[B]; rows not live run along (static shapes) but do not commit."""
        from jaxdecode.models import advance, forward
        b = tokens.shape[0]
        logits, _, cache = forward(self.config, self.params, tokens[:, None], cache.lengths[:, None], cache,
                                   jnp.ones((b, 1, 1), bool))
        return advance(cache, live.astype(jnp.int32)), logits[:, 0]


jax.tree_util.register_dataclass(ModelLM, data_fields=["params"], meta_fields=["config", "cache_len"])


@dataclasses.dataclass(frozen=True)
class PrefixFnLM:
    """A jit-able `logits_fn(tokens[B, T], lengths[B]) -> logits[B, V]` behind `start` / `step`: the carry
    is the token buffer (width = prompt + new tokens) and the lengths."""
    fn: object
    vocab_size: int
    width: int = 0

    def start(self, prompt_tokens, prompt_lengths):
        buf = jnp.pad(prompt_tokens, ((0, 0), (0, self.width - prompt_tokens.shape[1])))
        return (buf, prompt_lengths), self.fn(buf, prompt_lengths)

    def step(self, carry, tokens, live):
        buf, lengths = carry
        rows, col = jnp.arange(buf.shape[0]), jnp.minimum(lengths, buf.shape[1] - 1)
        buf = buf.at[rows, col].set(jnp.where(live, tokens, buf[rows, col]))
        lengths = lengths + live.astype(jnp.int32)
        return (buf, lengths), self.fn(buf, lengths)


jax.tree_util.register_dataclass(PrefixFnLM, data_fields=[], meta_fields=["fn", "vocab_size", "width"])


def as_lm(model_or_fn, *, vocab_size=None, prompt_width: int, max_new_tokens: int, cache_len: int | None = None):
    """A ModelLM or PrefixFnLM sized for these prompts (see the module docstring)."""
    from jaxdecode.autoregressive import default_cache_len
    if isinstance(model_or_fn, PrefixFnLM):
        return dataclasses.replace(model_or_fn, width=prompt_width + max_new_tokens)
    if hasattr(model_or_fn, "config") and hasattr(model_or_fn, "params"):  # a Model or a ModelLM
        if cache_len is None:
            cache_len = getattr(model_or_fn, "cache_len", 0) or default_cache_len(prompt_width, max_new_tokens)
        return ModelLM(model_or_fn.config, model_or_fn.params, cache_len=cache_len)
    if callable(model_or_fn):
        if vocab_size is None:
            raise AsapError("a logits function needs vocab_size= (the width of the logits it returns)")
        return PrefixFnLM(model_or_fn, int(vocab_size), width=prompt_width + max_new_tokens)
    raise AsapError(f"model_or_logprob_fn must be a jaxdecode Model, a ModelLM / PrefixFnLM, or a function "
                    f"(tokens[B, T], lengths[B]) -> logits[B, V]; got {type(model_or_fn).__name__}")


# ----------------------------------------------------------------------------- the trie (host)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrieArrays:
    """The trie as the device reads it: node u's children are slots indptr[u] .. indptr[u] + count[u]."""
    indptr: jax.Array  # int32[Ncap]
    count: jax.Array  # int32[Ncap]
    token: jax.Array  # int32[Ecap]: the child's token
    efg: jax.Array  # f32[Ecap]: the child's EFG~
    child: jax.Array  # int32[Ecap]: the child's node id


class AsapTrie:
    """Sampled prefixes of every row with their EFG~ (float64, host). Node r < rows is row r's root."""

    def __init__(self, rows: int):
        self.rows = int(rows)
        self.parent = [-1] * rows
        self.token = [-1] * rows
        self.p = [1.0] * rows  # p(token | parent prefix)
        self.mass = [math.nan] * rows  # allowed non-EOS mass of the next-token distribution (nan: unexpanded)
        self.eos = [0.0] * rows  # allowed EOS mass (EFG~(w EOS) = 1: never stored as a child)
        self.nallow = [0] * rows  # allowed non-EOS tokens: all visited -> no unexplored mass, exactly
        self.s1 = [0.0] * rows  # sum over children of p
        self.s2 = [0.0] * rows  # sum over children of p * EFG~
        self.efg = [1.0] * rows
        self.terminal = [False] * rows  # a fixed EFG~: 1 (finished without EOS) or 0 (cut off)
        self.children: list[dict] = [{} for _ in range(rows)]

    def __len__(self) -> int:
        return len(self.parent)

    def root_efg(self, row: int) -> float:
        return self.efg[row]

    def node(self, row: int, prefix) -> int:
        """The node of `prefix` (new tokens) in row's trie, or -1 if it was never sampled."""
        u = row
        for t in prefix:
            u = self.children[u].get(int(t), -1)
            if u < 0:
                return -1
        return u

    def _new_child(self, u: int, t: int, p: float) -> int:
        v = len(self.parent)
        self.parent.append(u)
        self.token.append(t)
        self.p.append(p)
        self.mass.append(math.nan)
        self.eos.append(0.0)
        self.nallow.append(0)
        self.s1.append(0.0)
        self.s2.append(0.0)
        self.efg.append(1.0)  # allowed and unexplored: the mask's bound
        self.terminal.append(False)
        self.children.append({})
        self.children[u][t] = v
        self.s1[u] += p
        self.s2[u] += p
        return v

    def _set_efg(self, v: int, value: float) -> None:
        u = self.parent[v]
        if u >= 0:
            self.s2[u] += self.p[v] * (value - self.efg[v])
        self.efg[v] = value

    def add(self, row: int, tokens, n: int, logp, logmass, logeos, nallow, status: int, eos_ids: tuple) -> None:
        """Insert one sample (its first n tokens; at step i: logp[i] = log p(tokens[i] | prefix), logmass[i]
        and logeos[i] = log of the allowed non-EOS and EOS mass, nallow[i] = allowed non-EOS tokens) and
        update EFG~ along its path, leaf first."""
        u, path = row, [row]
        for i in range(n):
            if math.isnan(self.mass[u]):
                self.mass[u], self.eos[u] = math.exp(float(logmass[i])), math.exp(float(logeos[i]))
                self.nallow[u] = int(nallow[i])
            t = int(tokens[i])
            if t in eos_ids:  # EFG~(w EOS) = 1 where EOS is allowed: not stored
                break
            v = self.children[u].get(t)
            if v is None:
                v = self._new_child(u, t, math.exp(float(logp[i])))
            u = v
            path.append(u)
        if status == DEAD_END and math.isnan(self.mass[u]):  # the step after the last token allowed nothing
            self.mass[u] = 0.0
        elif status == COMPLETE and math.isnan(self.mass[u]):  # finished without EOS: an accepted leaf
            self.terminal[u] = True
            self._set_efg(u, 1.0)
        elif status == CUT_OFF:
            self.terminal[u] = True
            self._set_efg(u, 0.0)
        for v in reversed(path):
            if not self.terminal[v] and not math.isnan(self.mass[v]):
                # allowed-but-unvisited children count 1 (clamped: float32 noise)
                rest = 0.0 if len(self.children[v]) >= self.nallow[v] else max(self.mass[v] - self.s1[v], 0.0)
                self._set_efg(v, self.eos[v] + rest + self.s2[v])

    def arrays(self) -> tuple[TrieArrays, int]:
        """(device arrays, window width): slots for `cap` nodes and edges (1024, 4096, ...), the window a
        power of two >= the widest node (16 at least)."""
        n = len(self.parent)
        parent = np.asarray(self.parent[self.rows:], np.int64)
        order = np.argsort(parent, kind="stable")
        count = np.bincount(parent, minlength=n) if parent.size else np.zeros(n, np.int64)
        indptr = np.concatenate([[0], np.cumsum(count)[:-1]])
        cap = _MIN_CAPACITY
        while cap < n:
            cap *= 4
        width = next_pow2(max(int(count.max(initial=1)), _MIN_WIDTH))

        def pad(x, cap, dtype):
            out = np.zeros(cap, dtype)
            out[:x.size] = x
            return out

        ids = np.arange(self.rows, n)[order]
        arrays = TrieArrays(indptr=jnp.asarray(pad(indptr, cap, np.int32)),
                            count=jnp.asarray(pad(count, cap, np.int32)),
                            token=jnp.asarray(pad(np.asarray(self.token, np.int64)[ids], cap, np.int32)),
                            efg=jnp.asarray(pad(np.asarray(self.efg, np.float64)[ids], cap, np.float32)),
                            child=jnp.asarray(pad(ids, cap, np.int32)))
        return arrays, width

    def proposal_log_prob(self, row: int, seq, logprobs_at, allowed_at, eos_ids: tuple) -> float:
        """log q(seq) under the proposal the next round would sample from (host; for toys and tests).
        seq: the new tokens, EOS included if it ends with one; logprobs_at(prefix) -> float[V] the LM's
        log p(. | prefix); allowed_at(prefix) -> bool[V] the constraint's mask (EOS included). An empty trie
        gives plain masking's probability."""
        u, total = row, 0.0
        for i, t in enumerate(seq):
            t = int(t)
            lp = np.asarray(logprobs_at(seq[:i]), np.float64)
            ok = np.asarray(allowed_at(seq[:i]), bool)
            if not ok[t]:
                return -math.inf
            if u >= 0 and not math.isnan(self.mass[u]):
                z = self.efg[u]
                v = -1 if t in eos_ids else self.children[u].get(t, -1)
                w = 1.0 if v < 0 else self.efg[v]
            else:  # an unexplored prefix: the mask
                z = float(np.exp(lp[ok]).sum())
                v, w = -1, 1.0
            if w <= 0.0 or z <= 0.0:
                return -math.inf
            total += lp[t] + math.log(w) - math.log(z)
            u = v
        return total


# ----------------------------------------------------------------------------- one round (device)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Round:
    step: jax.Array  # int32
    tokens: jax.Array  # int32[B, N]
    logp: jax.Array  # f32[B, N]: log p(token | prefix)
    logq: jax.Array  # f32[B, N]: log q(token | prefix), the proposal it was drawn from
    logmass: jax.Array  # f32[B, N]: log of the allowed non-EOS mass at the step
    logeos: jax.Array  # f32[B, N]: log of the allowed EOS mass at the step
    nallow: jax.Array  # int32[B, N]: allowed non-EOS tokens at the step
    done: jax.Array  # bool[B]
    status: jax.Array  # int32[B]
    n_new: jax.Array  # int32[B]
    node: jax.Array  # int32[B]: trie node of the prefix, -1 once off the trie
    carry: object
    cstate: object
    key: jax.Array
    nonfinite: jax.Array  # bool[B]

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _children(trie: TrieArrays, node, width: int):
    """Tokens, EFG~ and node ids of each row's children: [B, width] each, and the valid slots."""
    slot = jnp.arange(width, dtype=jnp.int32)[None, :]
    start = jnp.take(trie.indptr, jnp.maximum(node, 0))[:, None]
    valid = slot < jnp.where(node >= 0, jnp.take(trie.count, jnp.maximum(node, 0)), 0)[:, None]
    idx = jnp.where(valid, start + slot, 0)
    return jnp.take(trie.token, idx), jnp.take(trie.efg, idx), jnp.take(trie.child, idx), valid


@partial(jax.jit, static_argnames=("max_new_tokens", "sampler", "eos_ids", "width", "per_prompt"))
def _round(lm, carry, logits, constraint, trie: TrieArrays, key, *, max_new_tokens, sampler, eos_ids, width,
           per_prompt=1):
    """One round: `per_prompt` samples of each prompt (rows b * per_prompt ...: prompt b, whose trie root is
    node b) from the proposal p(y | w) * EFG~(w y), starting after the prompt."""
    from jaxdecode.autoregressive import is_eos, nonfinite_rows
    b = logits.shape[0]
    n = max_new_tokens
    neg = jnp.full((b, n), -jnp.inf, jnp.float32)
    state = _Round(step=jnp.int32(0), tokens=jnp.full((b, n), eos_ids[0] if eos_ids else 0, jnp.int32),
                   logp=neg, logq=neg, logmass=neg, logeos=neg, nallow=jnp.zeros((b, n), jnp.int32),
                   done=jnp.zeros((b,), bool),
                   status=jnp.full((b,), CUT_OFF, jnp.int32), n_new=jnp.zeros((b,), jnp.int32),
                   node=jnp.arange(b, dtype=jnp.int32) // per_prompt, carry=carry,
                   cstate=constraint.init(b // per_prompt, per_prompt), key=key, nonfinite=jnp.zeros((b,), bool))

    def choose(state, logits):
        live = ~state.done
        key, sub = jax.random.split(state.key)
        nonfinite = state.nonfinite | nonfinite_rows(logits, live)
        logprobs = process_logits(logits, sampler)  # [B, V]
        allowed = constraint.allowed(state.cstate, logprobs.shape[-1]) & (logprobs > -jnp.inf)
        eos = is_eos(jnp.arange(logprobs.shape[-1]), eos_ids)[None, :]  # [1, V]
        logmass = jax.nn.logsumexp(jnp.where(allowed & ~eos, logprobs, -jnp.inf), axis=-1)  # [B]
        logeos = jax.nn.logsumexp(jnp.where(allowed & eos, logprobs, -jnp.inf), axis=-1)  # [B]
        nallow = jnp.sum(allowed & ~eos, axis=-1, dtype=jnp.int32)
        ctok, cefg, cnode, valid = _children(trie, state.node, width)  # [B, W]
        rows = jnp.arange(b)[:, None]
        logw = jnp.zeros_like(logprobs).at[rows, jnp.where(valid, ctok, logprobs.shape[-1])].set(
            jnp.log(cefg), mode="drop")  # EFG~ of visited children; 1 (log 0) elsewhere
        score = jnp.where(allowed, logprobs + logw, -jnp.inf)
        # no allowed token, or every allowed one known to lead nowhere (EFG~ 0: only when L is empty here)
        dead = live & ~jnp.any(score > -jnp.inf, axis=-1)
        logq_all = jax.nn.log_softmax(score, axis=-1)
        token = jax.random.categorical(sub, jnp.where(dead[:, None], 0.0, score), axis=-1).astype(jnp.int32)
        hit = valid & (ctok == token[:, None])
        node = jnp.where(jnp.any(hit, axis=-1), jnp.sum(jnp.where(hit, cnode, 0), axis=-1), -1)
        emit = live & ~dead

        def pick(a):
            return jnp.take_along_axis(a, token[:, None], axis=-1)[:, 0]

        col = state.step

        def put(arr, val, where):
            return arr.at[:, col].set(jnp.where(where, val, arr[:, col]))

        ended = emit & is_eos(token, eos_ids)
        moved = constraint.advance(state.cstate, token)
        from jaxdecode.constraints.protocol import select_rows
        cstate = select_rows(emit, moved, state.cstate)
        complete = ended | (emit & constraint.complete(cstate))
        status = jnp.where(complete, COMPLETE, jnp.where(dead, DEAD_END, state.status))
        return state.replace(
            step=col + 1, key=key, nonfinite=nonfinite, cstate=cstate,
            tokens=put(state.tokens, token, emit), logp=put(state.logp, pick(logprobs), emit),
            logq=put(state.logq, pick(logq_all), emit), logmass=put(state.logmass, logmass, live),
            logeos=put(state.logeos, logeos, live), nallow=put(state.nallow, nallow, live),
            done=state.done | complete | dead, status=status, n_new=state.n_new + emit.astype(jnp.int32),
            node=jnp.where(emit, node, state.node))

    def cond(state):
        return (state.step < n) & ~jnp.all(state.done)

    def body(state):
        carry, logits = lm.step(state.carry, state.tokens[:, state.step - 1], ~state.done)
        return choose(state.replace(carry=carry), logits)

    state = jax.lax.while_loop(cond, body, choose(state, logits))
    # a dead end found at the step after the last emitted token sits in column n_new
    return (state.tokens, state.n_new, state.logp, state.logq, state.logmass, state.logeos, state.nallow,
            state.status, state.nonfinite, state.step)


# ----------------------------------------------------------------------------- the driver
_start = jax.jit(lambda lm, tokens, lengths: lm.start(tokens, lengths))


@dataclasses.dataclass(frozen=True)
class AsapOutput:
    """Every sample of every row, in the order drawn (host NumPy)."""
    tokens: np.ndarray  # int32[B, S, N]: new tokens (pad after the end)
    lengths: np.ndarray  # int32[B, S]: new tokens of each sample, EOS included
    status: np.ndarray  # int8[B, S]: COMPLETE, CUT_OFF or DEAD_END (STATUS_NAMES)
    log_p: np.ndarray  # f64[B, S]: log p(sample) under the LM (the sampler's distribution), EOS included
    log_q: np.ndarray  # f64[B, S]: log probability under the proposal it was drawn from
    log_mass: np.ndarray  # f64[B, S]: log EFG~(root) after each sample: an upper bound on log P(L), falling
    trie: AsapTrie
    forwards: int  # LM forwards, all rounds (the prefill once)
    nonfinite: np.ndarray  # bool[B]: the LM's logits held NaN/inf while a row was sampling

    def last(self, complete: bool = True):
        """(tokens[B, N], lengths[B], index[B]) of each row's last sample (the last complete one when
        `complete`, falling back to the last sample in rows where none completed)."""
        b, s = self.status.shape
        ok = self.status == COMPLETE if complete else np.ones((b, s), bool)
        idx = np.where(ok.any(1), s - 1 - np.argmax(ok[:, ::-1], axis=1), s - 1)
        return self.tokens[np.arange(b), idx], self.lengths[np.arange(b), idx], idx

    def distribution(self, row: int = 0) -> dict:
        """The final proposal restricted to the distinct complete samples of `row`: {tokens: probability},
        exactly p(x) / EFG~(root) (see the module docstring). The probabilities sum to <= 1; the rest is
        the proposal's mass on strings never sampled."""
        out = {}
        for s in np.flatnonzero(self.status[row] == COMPLETE):
            out[tuple(int(t) for t in self.tokens[row, s, :self.lengths[row, s]])] = float(
                np.exp(self.log_p[row, s] - self.log_mass[row, -1]))
        return out


def asap_sample(model_or_logprob_fn, constraint, num_samples: int, prompt_tokens, prompt_lengths=None, *,
                max_new_tokens: int, eos_ids=(), sampler: SamplerConfig = SamplerConfig(), seed: int = 0,
                key=None, vocab_size: int | None = None, cache_len: int | None = None,
                samples_per_round: int = 1, update: bool = True) -> AsapOutput:
    """Draw `num_samples` ASAp samples per prompt row under `constraint` (see the module docstring).

    model_or_logprob_fn: a jaxdecode Model / ModelLM, or a jit-able logits_fn(tokens[B, T], lengths[B])
    -> logits[B, V] (then vocab_size=). prompt_tokens: int[B, P] right-padded (lengths int[B]; None =
    full width). cache_len: KV slots per row (a Model; default prompt + new tokens rounded up to 64). The
    target is p(x | x in L, len(x) <= max_new_tokens) with p the `sampler`'s
    distribution (temperature / top-k / top-p / min-p).

    samples_per_round: 1 is the paper's rule (each sample sees the trie every earlier one left). k > 1
    draws k samples of each prompt per round from the same proposal, as k batch rows, then inserts them
    all: num_samples / k sequential rounds instead of num_samples. The bound stays an upper bound and
    tightens the same way (the proposal just lags by up to k - 1 samples); num_samples must be a multiple
    of k. update=False keeps the trie empty: every round is plain masked sampling (the baseline ASAp
    corrects), drawn by the same loop."""
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise AsapError(f"num_samples (the budget) must be an int >= 1, got {num_samples!r}")
    k = samples_per_round
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or num_samples % k:
        raise AsapError(f"samples_per_round must be an int >= 1 dividing num_samples ({num_samples}), got {k!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise AsapError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(sampler, SamplerConfig):
        raise AsapError(f"sampler must be a SamplerConfig, got {type(sampler).__name__}")
    if sampler.is_greedy:
        raise AsapError("ASAp samples: temperature 0 (greedy) has no distribution to align; use temperature > 0 "
                        "(greedy decoding under the constraint is method 'greedy' with the constraint)")
    if sampler.uses_seen_tokens:
        raise AsapError("ASAp needs p(next | prefix) to depend on the prefix only: repetition_penalty must be 1")
    if constraint is None:
        raise AsapError("ASAp needs a constraint (regex, JSON schema, grammar or item set): pass constraint=")
    toks = np.asarray(prompt_tokens)
    if toks.ndim != 2 or toks.shape[0] == 0 or toks.shape[1] == 0:
        raise AsapError(f"prompt_tokens must be int[B, P] with B, P >= 1, got shape {toks.shape}")
    lens = np.full(toks.shape[0], toks.shape[1], np.int32) if prompt_lengths is None else np.asarray(prompt_lengths)
    eos_ids = tuple(int(e) for e in eos_ids)
    lm = as_lm(model_or_logprob_fn, vocab_size=vocab_size, prompt_width=toks.shape[1],
               max_new_tokens=max_new_tokens, cache_len=cache_len)
    if isinstance(lm, ModelLM):
        from jaxdecode.autoregressive import validate_eos_ids, validate_prompts
        eos_ids = validate_eos_ids(lm.config, eos_ids)
        toks, lens = validate_prompts(lm.config, toks, lens, max_new_tokens, lm.cache_len)
    else:
        bad = (lens < 1) | (lens > toks.shape[1])
        if bad.any():
            raise AsapError(f"prompt_lengths must be in [1, {toks.shape[1]}], got {lens.tolist()}")
        toks, lens = jnp.asarray(toks, jnp.int32), jnp.asarray(lens, jnp.int32)
    b = int(toks.shape[0])
    constraint = constraint.prepare(lm.vocab_size, eos_ids, max_new_tokens, b)
    key = jax.random.PRNGKey(seed) if key is None else key

    # the prompts once (each k times: k rows per prompt); every round starts from this cache
    carry, logits0 = _start(lm, jnp.repeat(toks, k, axis=0), jnp.repeat(lens, k, axis=0))
    trie = AsapTrie(b)
    n = max_new_tokens
    out_tok = np.zeros((b, num_samples, n), np.int32)
    out_len = np.zeros((b, num_samples), np.int32)
    out_status = np.zeros((b, num_samples), np.int8)
    log_p = np.zeros((b, num_samples))
    log_q = np.zeros((b, num_samples))
    log_mass = np.zeros((b, num_samples))
    nonfinite = np.zeros(b, bool)
    forwards = 1
    for first in range(0, num_samples, k):  # sequential by nature: each round reads the trie the last one left
        key, sub = jax.random.split(key)
        arrays, width = trie.arrays()
        res = _round(lm, carry, logits0, constraint, arrays, sub, max_new_tokens=n, sampler=sampler,
                     eos_ids=eos_ids, width=width, per_prompt=k)
        tok, nn, lp, lq, lmass, leos, nal, st, nf, steps = jax.device_get(res)
        forwards += int(steps) - 1
        nonfinite |= nf.reshape(b, k).any(axis=1)
        for i in range(b * k):  # row i = sample first + i % k of prompt i // k
            r, s, m = i // k, first + i % k, int(nn[i])
            if update:
                trie.add(r, tok[i], m, lp[i], lmass[i], leos[i], nal[i], int(st[i]), eos_ids)
            out_tok[r, s], out_len[r, s], out_status[r, s] = tok[i], m, st[i]
            log_p[r, s] = float(np.sum(lp[i, :m], dtype=np.float64))
            log_q[r, s] = float(np.sum(lq[i, :m], dtype=np.float64))
            log_mass[r, s] = math.log(trie.root_efg(r)) if trie.root_efg(r) > 0 else -math.inf
    return AsapOutput(tokens=out_tok, lengths=out_len, status=out_status, log_p=log_p, log_q=log_q,
                      log_mass=log_mass, trie=trie, forwards=forwards, nonfinite=nonfinite)


# ----------------------------------------------------------------------------- method "asap" of generate
ASAP_ROW_STATS = ("asap_valid", "asap_sample_index", "asap_complete_fraction", "asap_log_mass", "asap_samples",
                  "asap_sample_lengths", "asap_status")


def _constraint_for(model, opts: dict, batch: int):
    """The constraint of generate()'s structured-output options (jaxdecode.decoders.structured_constraint)."""
    from jaxdecode.decoders import structured_constraint
    c = structured_constraint(model, opts, batch)
    if c is None:
        raise AsapError("method 'asap' samples under a constraint: pass regex=, json_schema= or grammar= (CLI "
                        "--regex, --json-schema FILE, --grammar FILE)")
    return c


def run_asap(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
    """generate(method="asap"): `num_samples` rounds per prompt (the budget, default 16); the text
    returned is each prompt's LAST COMPLETE sample (drawn from the most corrected proposal; the last
    sample when none completed: stats asap_valid False). Every sample is in the stats."""
    if opts.get("mesh") is not None:
        raise AsapError("method 'asap' runs on one device (its rounds are sequential, one sample per prompt "
                        "each): drop mesh")
    constraint = _constraint_for(model, opts, int(prompt_tokens.shape[0]))
    num = opts.get("num_samples")
    temperature = opts.get("temperature")
    sampler = SamplerConfig(temperature=1.0 if temperature is None else float(temperature),
                            top_k=int(opts.get("top_k") or 0), top_p=float(opts.get("top_p") or 1.0),
                            min_p=float(opts.get("min_p") or 0.0))
    out = asap_sample(model, constraint, 16 if num is None else num, prompt_tokens, prompt_lengths,
                      max_new_tokens=max_new_tokens, eos_ids=opts["eos_ids"], sampler=sampler,
                      seed=int(opts.get("seed") or 0), cache_len=opts.get("cache_len"),
                      samples_per_round=1 if opts.get("samples_per_round") is None else opts["samples_per_round"])
    tokens, lengths, idx = out.last()
    rows = np.arange(tokens.shape[0])
    stats = {"target_calls": out.forwards, "nonfinite_logits": out.nonfinite,
             "asap_valid": out.status[rows, idx] == COMPLETE, "asap_sample_index": idx,
             "asap_complete_fraction": (out.status == COMPLETE).mean(axis=1),
             "asap_log_mass": out.log_mass[:, -1], "asap_samples": out.tokens, "asap_sample_lengths": out.lengths,
             "asap_status": out.status}
    return tokens, lengths, stats


def _register():
    from jaxdecode.options import method_options
    from jaxdecode.registry import register_method
    register_method("asap", run_asap, method_options("asap"), per_row_stats=ASAP_ROW_STATS,
                    description="grammar-aligned sampling (ASAp, Park et al. 2024): num_samples rounds under a "
                                "regex / JSON schema / grammar, each correcting masking's bias; the last "
                                "complete sample is returned")


_register()
