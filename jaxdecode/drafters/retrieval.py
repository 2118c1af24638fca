"""Retrieval drafting: each draft token is the continuation of the longest matching context, found in
the row's own text (prompt lookup) or in a datastore of the target's own output.

A small target is predictable in a way no draft model learns in minutes: its greedy text keeps to a
few habits (the same comment lines, the same call patterns), and it repeats its own context. Both are
lookups, and a lookup costs almost nothing next to a forward. The drafter proposes a chain of
`num_nodes` point-mass tokens (child_rule "point": verify with "greedy" or "point_mass"); for each
token, given the row's history plus the tokens drafted so far:

  - history match: the longest suffix n-gram (n <= history_ngram) that occurred earlier in the row
    (the most recent such occurrence), proposing the token that followed it;
  - datastore match: the longest context (order k <= max_order) the datastore holds, proposing the
    token that most often followed it in the target's own continuations (REST, He et al. 2023, and
    SuffixDecoding, Oliaro et al. 2024, retrieve from a corpus or from earlier outputs the same way);
  - the longer match wins, the history on a tie (it is this row's own text); no match ends the chain.

The datastore (`NgramTable`) is built on the host from token rows (`build_table`): for every order k
and every context of k tokens seen before a predicted position, the most frequent next token. Entries
live in a set-associative hash table: a context's two 32-bit hashes choose its bucket and check its
fingerprint, so a lookup is one gather of `ways` slots per order, vectorised over the batch and the
orders; the hashes are computed identically by numpy (build) and jax (lookup). A hash collision can
only make a draft token wrong, never the output: the verifier decides. (`prune=True` drops the entries
whose token their (k-1)-token suffix already predicts: the same back-off tokens from a tenth of the
entries, but the datastore's match then looks shorter than it is and loses ties it should win.)

The match length is the draft's confidence: with `confidence` (the acceptance by match length, measured
where the datastore was built, `match_acceptance`) the chain stops where the product of its tokens'
rates falls below `min_reach` (when sampling, the rates measured at that temperature), and each
node's class (its match length) keys the adaptive policy's estimates (jaxdecode.adaptive, "Confidence
classes"). With `by_source` a class is the pair (where the match was found, its length): a match in
the row's own text is kept far more often than a datastore match of the same length (the shipped
datastore, greedy, length 8: 0.96 against 0.79; at T = 0.7, length 2: 0.41 against 0.26), and a long
prompt has more of them, so rates by length alone shift with the prompt's length;
by source they do not (BENCHMARKS.md, "... confidence by where the match was found ..."). A datastore
built now stores rates by source, for chains of up to 16 tokens cut at reach 0.15 (training.retrieval
BUILD_DEFAULTS; with the cut at 0.25 and chains of 8, by-source rates stopped chains of datastore matches
early and did not pay, BENCHMARKS.md "Rates by source, chains of 16"). `sampled_confidence`
holds the same rates measured at sampling temperatures (the walk over sampled continuations: a
point-mass draft is accepted with the target's probability of its token, which is the chance the
sampled text holds it), so a policy sampling at such a temperature starts from its own measurement,
not the greedy one.

The shipped datastore (`jaxdecode train retrieval`) is the target's greedy continuations of training
prompts, stored as token rows in the trained-drafter format; the table is built when it is loaded.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.drafters.builders import chain_widths
from jaxdecode.drafters.ngram import check_int, suffix_match_maps
from jaxdecode.drafters.trained import DrafterKind, register_kind
from jaxdecode.sampling import _is_real
from jaxdecode.tree import chain_tree


class RetrievalError(ValueError):
    """A datastore or retrieval-drafter option that cannot work as asked."""

# Hash constants (uint32): FNV-1a style mixing per token, murmur3's finaliser on the result. Two seeds
# give two independent hashes per context: one picks the bucket, the other is the stored fingerprint.
_SEED_BUCKET = 0x811C9DC5
_SEED_FINGER = 0x9747B28C
_PRIME = 0x01000193
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35


def _fmix32(h, xp):
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(_FMIX1)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(_FMIX2)
    return h ^ (h >> xp.uint32(16))


def context_hashes(tokens, max_order: int, xp=jnp):
    """Hashes of the contexts ending at each position: (bucket_hash, fingerprint), each uint32
    [max_order, ..., T], where [k-1, ..., t] hashes the k tokens t-k+1 .. t, read from t backwards
    (entries with t < k-1 read wrapped-around tokens: callers mask them). Fingerprints are never 0
    (0 marks an empty slot). `xp` is numpy (building a table) or jax.numpy (looking up): same values."""
    tok = tokens.astype(xp.uint32) + xp.uint32(1)
    ha = xp.full(tok.shape, _SEED_BUCKET, xp.uint32)
    hb = xp.full(tok.shape, _SEED_FINGER, xp.uint32)
    outs_a, outs_b = [], []
    for k in range(max_order):  # static: the order grows by one token read further back
        ha, hb = _extend(ha, hb, xp.roll(tok, k, axis=-1), xp)
        outs_a.append(_fmix32(ha, xp))
        outs_b.append(_fingerprint(hb, xp))
    return xp.stack(outs_a), xp.stack(outs_b)


def _fingerprint(hb, xp):
    return _fmix32(hb, xp) | xp.uint32(1)  # never 0: 0 marks an empty slot


def _extend(ha, hb, tok, xp):
    """The running (bucket, fingerprint) hash states extended by one more token read backwards (uint32,
    token id + 1): one hash update of `context_hashes`, shared with the lookup of the newest context."""
    return (ha ^ tok) * xp.uint32(_PRIME), (hb ^ (tok * xp.uint32(0x9E3779B1))) * xp.uint32(_PRIME)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramTable:
    """A datastore of next tokens by context, set-associative: `ways` slots per bucket."""
    fingerprints: jax.Array  # uint32[S, W]: the context's second hash, 0 = empty slot
    tokens: jax.Array  # int32[S, W]: the most frequent next token of that context
    max_order: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_buckets(self) -> int:
        return self.fingerprints.shape[0]

    def lookup(self, last_tokens):
        """The longest stored context among the suffixes of `last_tokens` int32[B, K] (K = max_order,
        newest last; entries < 0 are no token): (token int32[B], order int32[B], 0 = no match)."""
        # the hashes of the contexts ending at the newest token only (context_hashes' values there)
        newest_first = last_tokens[:, ::-1].astype(jnp.uint32) + jnp.uint32(1)  # [B, K]
        ha = jnp.full(newest_first.shape[:1], _SEED_BUCKET, jnp.uint32)
        hb = jnp.full(newest_first.shape[:1], _SEED_FINGER, jnp.uint32)
        outs_a, outs_b = [], []
        for k in range(self.max_order):  # static
            ha, hb = _extend(ha, hb, newest_first[:, k], jnp)
            outs_a.append(_fmix32(ha, jnp))
            outs_b.append(_fingerprint(hb, jnp))
        ha, hb = jnp.stack(outs_a), jnp.stack(outs_b)  # [K(order), B]
        shift = 32 - int(np.log2(self.num_buckets))
        bucket = (ha >> jnp.uint32(shift)).astype(jnp.int32) if shift < 32 else jnp.zeros_like(ha, jnp.int32)
        fp = self.fingerprints[bucket]  # [K, B, W]
        hit = fp == hb[..., None]
        k = jnp.arange(1, self.max_order + 1, dtype=jnp.int32)[:, None]  # [K, 1]
        # a context is usable only when all its k tokens exist
        known = jnp.cumprod((last_tokens[:, ::-1] >= 0).astype(jnp.int32), axis=1).T.astype(bool)  # [K, B]
        found = jnp.any(hit, axis=-1) & known
        tok = jnp.sum(jnp.where(hit, self.tokens[bucket], 0), axis=-1)  # at most one hit per bucket
        order = jnp.max(jnp.where(found, k, 0), axis=0)  # [B]
        best = jnp.maximum(order - 1, 0)  # the index of the longest found order (k = index + 1)
        return jnp.take_along_axis(tok, best[None, :], axis=0)[0].astype(jnp.int32), order


def _mode_per_context(keys, nxt):
    """keys uint64[M], nxt int64[M] -> (unique keys, their most frequent next token, its count). Ties:
    the smaller token id."""
    order = np.lexsort((nxt, keys))
    k, n = keys[order], nxt[order]
    new_pair = np.ones(len(k), bool)
    new_pair[1:] = (k[1:] != k[:-1]) | (n[1:] != n[:-1])
    starts = np.flatnonzero(new_pair)
    pk, pn = k[starts], n[starts]
    pc = np.diff(np.append(starts, len(k)))
    best = np.lexsort((pn, -pc, pk))  # per key: the highest count first, then the lower token id
    pk, pn, pc = pk[best], pn[best], pc[best]
    first = np.ones(len(pk), bool)
    first[1:] = pk[1:] != pk[:-1]
    return pk[first], pn[first], pc[first]


def build_table(rows, lengths=None, starts=None, *, max_order: int = 8, ways: int = 4,
                load: float = 0.5, prune: bool = False) -> tuple[NgramTable, dict]:
    """The datastore of `rows` int[R, T] (token ids >= 0): for each order k <= max_order, the most
    frequent next token of each k-token context, over the predicted positions t with
    starts[r] <= t < lengths[r] (default: every position; a row's prompt is usually context only).

    Returns (table, stats): stats counts contexts per order, those dropped as redundant (their
    (k-1)-suffix predicts the same token) and those a full bucket could not take (lowest count first).
    """
    check_int("build_table", "max_order", max_order, 1)
    check_int("build_table", "ways", ways, 1)
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"build_table: rows must be an int array [R, T] with T >= 2, got {rows.dtype} "
                         f"{rows.shape}")
    r, t = rows.shape
    lengths = np.full(r, t) if lengths is None else np.asarray(lengths)
    starts = np.ones(r, int) if starts is None else np.maximum(np.asarray(starts), 1)
    if lengths.shape != (r,) or starts.shape != (r,):
        raise ValueError(f"build_table: lengths and starts need one entry per row ({r}), got "
                         f"{lengths.shape} and {starts.shape}")
    if (rows < 0).any():
        raise ValueError("build_table: rows hold negative token ids; mark padding with lengths instead")
    ha, hb = context_hashes(rows.astype(np.int64), max_order, np)  # [K, R, T], context ending at t
    col = np.arange(t)[None, :]
    # position t predicts token t+1 from the context ending at t
    predicted = (col + 1 >= starts[:, None]) & (col + 1 < lengths[:, None])
    nxt = np.concatenate([rows[:, 1:], np.zeros((r, 1), rows.dtype)], axis=1).astype(np.int64)
    stats = {"rows": int(r), "predicted_positions": int(predicted.sum()), "contexts": [], "redundant": [],
             "overflow": 0}
    entries = []  # (bucket hash, fingerprint, token, order, count) per kept context
    prev = None  # order k-1: (sorted keys, their tokens)
    for k in range(1, max_order + 1):
        ok = predicted & (col >= k - 1)
        key = (ha[k - 1][ok].astype(np.uint64) << np.uint64(32)) | hb[k - 1][ok].astype(np.uint64)
        ukeys, utok, ucount = _mode_per_context(key, nxt[ok])
        keep = np.ones(len(ukeys), bool)
        if prev is not None and prune:  # the same positions' order-(k-1) context is this one's suffix
            skey = (ha[k - 2][ok].astype(np.uint64) << np.uint64(32)) | hb[k - 2][ok].astype(np.uint64)
            first = np.unique(key, return_index=True)[1]  # one position per context (same order as ukeys)
            suffix_tok = prev[1][np.searchsorted(prev[0], skey[first])]
            keep = utok != suffix_tok
        stats["contexts"].append(int(len(ukeys)))
        stats["redundant"].append(int((~keep).sum()))
        entries.append((ukeys[keep] >> np.uint64(32), ukeys[keep] & np.uint64(0xFFFFFFFF), utok[keep],
                        np.full(int(keep.sum()), k), ucount[keep]))
        prev = (ukeys, utok)
    bh, fp, tok, order, count = (np.concatenate(x) for x in zip(*entries))
    size = 1 << max(0, int(np.ceil(np.log2(max(1.0, len(bh) / (ways * load))))))
    shift = 32 - int(np.log2(size))
    bucket = (bh >> np.uint64(shift)).astype(np.int64) if shift < 32 else np.zeros(len(bh), np.int64)
    by = np.lexsort((-order, -count, bucket))  # per bucket: the best supported contexts first
    bucket, fp, tok = bucket[by], fp[by], tok[by]
    first_of_bucket = np.searchsorted(bucket, bucket, side="left")
    slot = np.arange(len(bucket)) - first_of_bucket
    fits = slot < ways
    stats["overflow"] = int((~fits).sum())
    fingerprints = np.zeros((size, ways), np.uint32)
    tokens = np.zeros((size, ways), np.int32)
    fingerprints[bucket[fits], slot[fits]] = fp[fits].astype(np.uint32)
    tokens[bucket[fits], slot[fits]] = tok[fits]
    stats.update(entries=int(fits.sum()), buckets=size, ways=ways)
    table = NgramTable(fingerprints=jnp.asarray(fingerprints), tokens=jnp.asarray(tokens), max_order=max_order)
    return table, stats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetrievalDrafter:
    """A chain of `num_nodes` tokens, each the continuation of the longest match in the row's own text
    (up to `history_ngram` tokens) or in the datastore `table` (up to its max_order); see the module
    docstring. table=None drafts from the history alone (prompt lookup that re-matches after every
    drafted token)."""

    table: NgramTable | None = None
    num_nodes: int = dataclasses.field(default=8, metadata=dict(static=True))
    history_ngram: int = dataclasses.field(default=8, metadata=dict(static=True))
    # P(the target accepts a token | it accepted its parent) by the token's winning match length 1, 2,
    # ... (longer ones take the last entry), measured where the datastore was built; with min_reach > 0
    # the chain ends before the first token whose reach (the product of these along the chain) falls
    # below min_reach: a weak match is not worth a verified node (SpecDec++'s stopping rule, with the
    # match length as the free confidence signal).
    confidence: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    min_reach: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    # The same rates measured when sampling: ((temperature, rates by match length), ...); see class_prior_at.
    sampled_confidence: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # The target's acceptance by depth measured where the datastore was built (the adaptive policy's
    # starting estimates); () = the policy's flat prior.
    acceptance_prior: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # Classes by (source, match length): `confidence` (and each sampled rates tuple) holds 2L rates, the
    # datastore's matches of length 1..L, then the row's own text's (node_classes). Needs a table.
    by_source: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # The temperature the target samples at: the confidence cut multiplies the rates measured there
    # (class_prior_at), since a point-mass draft is kept less often when sampling; at 0 the greedy rates.
    # Greedy rates cut sampled chains too late, and at T = 0.7 the adaptive policy drafted at a loss.
    temperature: float = dataclasses.field(default=0.0, metadata=dict(static=True))

    child_rule = "point"
    is_chain = True
    max_depth = property(lambda self: self.num_nodes)
    history_only = True  # observe is the identity: see speculative.Drafter

    def __post_init__(self):
        check_int("RetrievalDrafter", "num_nodes", self.num_nodes, 1)
        check_int("RetrievalDrafter", "history_ngram", self.history_ngram, 1)
        conf = tuple(float(c) for c in self.confidence)
        if not all(0.0 <= c <= 1.0 for c in conf):
            raise RetrievalError(f"RetrievalDrafter: confidence must hold probabilities, got {self.confidence!r}")
        object.__setattr__(self, "confidence", conf)
        object.__setattr__(self, "sampled_confidence",
                           check_sampled_confidence("RetrievalDrafter", self.sampled_confidence, conf))
        if not 0.0 <= self.min_reach <= 1.0:
            raise RetrievalError(f"RetrievalDrafter: min_reach must be in [0, 1], got {self.min_reach!r}")
        if self.min_reach > 0 and not conf:
            raise RetrievalError("RetrievalDrafter: min_reach needs the confidence by match length "
                                 "(measured by `jaxdecode train retrieval`, or given as confidence=(...))")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise RetrievalError(f"RetrievalDrafter: temperature must be a finite number >= 0 (the sampling "
                                 f"temperature whose rates the cut reads), got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.table is not None and not isinstance(self.table, NgramTable):
            raise ValueError(f"RetrievalDrafter: table must be an NgramTable (build_table) or None, got "
                             f"{type(self.table).__name__}")
        check_by_source("RetrievalDrafter", self.by_source, conf, has_table=self.table is not None)

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return ()  # stateless: the history and the datastore hold all it reads

    def draft(self, history, hist_len, with_match: bool = False):
        """(tokens int32[B, num_nodes], valid bool[B, num_nodes]) for rows with `hist_len` tokens of
        `history` int32[B, H] committed (the pending one last); with_match adds each token's winning
        match length int32[B, num_nodes] (0 past the chain's end) and whether the row's own text won it
        bool[B, num_nodes] (it wins ties)."""
        b, h = history.shape
        ng = self.history_ngram
        col = jnp.arange(h, dtype=jnp.int32)[None, :]
        # match[b, e]: how many tokens (<= ng) the text ending at e shares with the text's end
        match = sum(m.astype(jnp.int32) for m in suffix_match_maps(history, hist_len, ng))
        order_k = 0 if self.table is None else self.table.max_order

        def step(carry, _):
            work, length, match, alive = carry
            earlier = (col <= (length - 2)[:, None]) & (match > 0)
            # the longest match, the latest among equals: one max over (match, position) packed as
            # match * h + col (XLA:CPU's argmax is several times slower than a max), unpacked after
            top = jnp.max(jnp.where(earlier, match * h + col, -1), axis=1)
            end = jnp.where(top >= 0, top % h, 0).astype(jnp.int32)
            n_hist = jnp.where(top >= 0, top // h, 0).astype(jnp.int32)
            tok = jnp.take_along_axis(work, jnp.clip(end + 1, 0, h - 1)[:, None], axis=1)[:, 0]
            own = jnp.ones_like(alive)  # the row's own text won the match
            if self.table is not None:
                idx = length[:, None] - order_k + jnp.arange(order_k, dtype=jnp.int32)[None, :]
                last = jnp.where(idx >= 0, jnp.take_along_axis(work, jnp.clip(idx, 0, h - 1), axis=1), -1)
                stored, n_store = self.table.lookup(last)
                own = n_hist >= n_store
                tok = jnp.where(own, tok, stored)
                n_hist = jnp.maximum(n_hist, n_store)
            alive = alive & (n_hist > 0)  # n_hist is now the winning match length
            tok = jnp.where(alive, tok, 0).astype(jnp.int32)
            # the drafted token extends the text: each occurrence's match grows by one where it goes on
            prev = jnp.pad(match, ((0, 0), (1, 0)))[:, :h]
            match = jnp.where(work == tok[:, None], jnp.minimum(prev + 1, ng), 0)
            work = jnp.where(col == length[:, None], tok[:, None], work)
            return ((work, jnp.minimum(length + 1, h - 1), match, alive),
                    (tok, alive, jnp.where(alive, n_hist, 0), own & alive))

        init = (history, hist_len.astype(jnp.int32), match, jnp.ones((b,), bool))
        _, (tokens, valid, strength, own) = jax.lax.scan(step, init, None, length=self.num_nodes)
        tokens, valid, strength, own = tokens.T, valid.T, strength.T, own.T
        if self.min_reach > 0:
            conf = jnp.asarray(self.class_prior_at(self.temperature)[0], jnp.float32)
            reach = jnp.cumprod(conf[self.node_classes(strength, own)], axis=1)
            valid = valid & (reach >= self.min_reach)  # reach only falls along the chain: a prefix stays
        return (tokens, valid, strength, own) if with_match else (tokens, valid)

    def node_classes(self, strength, own):
        """Each token's confidence class (its index into `confidence`) from its winning match length
        (>= 1; longer ones share the last length's class) and, with by_source, whether the row's own
        text won it (the second half of the classes)."""
        per_source = len(self.confidence) // 2 if self.by_source else len(self.confidence)
        cls = jnp.clip(strength, 1, per_source) - 1
        return (cls + per_source * own.astype(cls.dtype)) if self.by_source else cls

    @property
    def verify_widths(self):
        """With a confidence cut the chain's length varies: the forward runs over the smallest of these
        that holds it (speculative_decode's verify_widths)."""
        return chain_widths(self.num_nodes) if self.min_reach > 0 else None

    @property
    def confidence_classes(self) -> int:
        """Classes of the adaptive policy's estimates (speculative.policy_for): one per match length
        the confidence table tells apart (per source with by_source; the last class, a long match in
        the row's own text, is the most confident), 0 without one."""
        return len(self.confidence)

    @property
    def class_prior(self) -> tuple:
        return self.confidence

    def class_prior_at(self, temperature: float) -> tuple[tuple, bool]:
        """(acceptance by match length when sampling at `temperature`, measured): the rates measured at
        that temperature (within SAMPLED_CONFIDENCE_TOLERANCE; measured: True), else a guess (False):
        interpolated linearly between the nearest measured temperatures (the greedy rates at 0), the
        highest one's beyond it. () without a confidence table."""
        if not self.confidence:
            return (), False
        known = sorted(((0.0, self.confidence),) + self.sampled_confidence)
        t = float(temperature)
        for at, rates in known:
            if abs(at - t) <= SAMPLED_CONFIDENCE_TOLERANCE:
                return rates, True
        below = [k for k in known if k[0] < t][-1]
        above = [k for k in known if k[0] > t][:1]
        if not above:
            return below[1], False
        (t0, r0), (t1, r1) = below, above[0]
        w = (t - t0) / (t1 - t0)
        return tuple(round((1 - w) * a + w * b, 4) for a, b in zip(r0, r1)), False

    def propose(self, state, ctx, sampler):
        tokens, valid, strength, own = self.draft(ctx.history, ctx.hist_len, with_match=True)
        tree = chain_tree(tokens, valid)
        if self.confidence:
            tree = tree.replace(classes=self.node_classes(strength, own))
        return tree, None, state

    def observe(self, state, obs):
        return state


# ----------------------------------------------------------------------------- the trained kind
@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """A shipped datastore: how its table is built and how the drafter reads it (`jaxdecode train
    retrieval`; the rows themselves are the drafter's params)."""
    max_order: int = 8  # longest datastore context, in tokens
    history_ngram: int = 8  # longest match looked for in the row's own text
    num_nodes: int = 8  # chain length when the tree option does not say (tree="chain:N"); builds store 16
    ways: int = 4  # slots per hash bucket
    load: float = 0.5  # entries per slot the table is sized for
    # Acceptance by winning match length, measured on held-out prompts when the datastore is built
    # (match_acceptance), and the reach below which a chain stops (RetrievalDrafter); () / 0: no cut.
    confidence: tuple = ()
    min_reach: float = 0.25  # no effect without confidence; builds store 0.15 (with rates by source)
    # The acceptance by match length at sampling temperatures, measured the same way over sampled
    # continuations: ((temperature, rates), ...); the adaptive policy's start when sampling there.
    sampled_confidence: tuple = ()
    # The rates above by (source, match length): datastore matches' L rates, then the row's own text's
    # (RetrievalDrafter.by_source). False here, so a datastore saved before the field existed reads as it
    # was measured (rates by length); a build now stores True (training.retrieval.BUILD_DEFAULTS).
    by_source: bool = False

    def __post_init__(self):
        for name in ("max_order", "history_ngram", "num_nodes", "ways"):
            check_int("RetrievalConfig", name, getattr(self, name), 1)
        if not 0.0 < self.load <= 1.0:
            raise RetrievalError(f"RetrievalConfig: load must be in (0, 1], got {self.load!r}")
        if not 0.0 <= self.min_reach <= 1.0 or not all(0.0 <= float(c) <= 1.0 for c in self.confidence):
            raise RetrievalError(f"RetrievalConfig: min_reach and confidence must be probabilities, got "
                                 f"{self.min_reach!r} and {self.confidence!r}")
        object.__setattr__(self, "confidence", tuple(float(c) for c in self.confidence))
        object.__setattr__(self, "sampled_confidence",
                           check_sampled_confidence("RetrievalConfig", self.sampled_confidence, self.confidence))
        check_by_source("RetrievalConfig", self.by_source, self.confidence)


# A rate measured at temperature t serves a sampler within this of t; elsewhere the policy guesses.
SAMPLED_CONFIDENCE_TOLERANCE = 0.05


def check_sampled_confidence(owner: str, pairs, confidence: tuple) -> tuple:
    """((temperature, rates), ...) as floats, each temperature > 0 and once, each rates tuple of
    probabilities as long as the greedy `confidence` (the classes are the same match lengths)."""
    how = ("give ((temperature, (rate for match length 1, 2, ...)), ...), measured by "
           "`jaxdecode train retrieval --confidence-temperatures`")
    try:
        out = tuple((float(t), tuple(float(r) for r in rates)) for t, rates in pairs)
    except (TypeError, ValueError):
        raise RetrievalError(f"{owner}: sampled_confidence {pairs!r} is not a list of (temperature, rates) "
                             f"pairs: {how}") from None
    temps = [t for t, _ in out]
    if out and not confidence:
        raise RetrievalError(f"{owner}: sampled_confidence needs the greedy confidence beside it (the same "
                             f"match-length classes): {how}")
    if any(not t > 0 or not np.isfinite(t) for t in temps) or len(set(temps)) != len(temps):
        raise RetrievalError(f"{owner}: sampled_confidence temperatures must be finite, > 0 (greedy rates are "
                             f"`confidence`) and given once each, got {temps}")
    for t, rates in out:
        if len(rates) != len(confidence) or not all(0.0 <= r <= 1.0 for r in rates):
            raise RetrievalError(f"{owner}: sampled_confidence at temperature {t} must hold {len(confidence)} "
                                 f"probabilities (one per match length, as `confidence`), got {rates}")
    return out


def check_by_source(owner: str, by_source, confidence: tuple, has_table: bool = True) -> None:
    """by_source is a bool; with it the rates come in two halves (datastore, own text) of one length each,
    and there is a datastore to tell the sources apart."""
    if not isinstance(by_source, (bool, np.bool_)):
        raise RetrievalError(f"{owner}: by_source must be true or false, got {by_source!r}")
    if not by_source:
        return
    if not has_table:
        raise RetrievalError(f"{owner}: by_source tells datastore matches from the row's own text, but there is "
                             f"no datastore (table=None); drop by_source for prompt lookup")
    if len(confidence) % 2:
        raise RetrievalError(f"{owner}: with by_source, confidence holds the datastore's rates by match length "
                             f"1..L, then the row's own text's (2L in all), got {len(confidence)} rates; measure "
                             f"them with `jaxdecode train retrieval` (or set by_source=false for rates by "
                             f"length alone)")


def datastore_params(rows, lengths, starts) -> dict:
    """The params of a retrieval drafter: its token rows (uint16 when the ids fit: half the bytes on
    disk), each row's length and first predicted position."""
    rows = np.asarray(rows)
    dtype = np.uint16 if rows.size == 0 or int(rows.max()) < 2 ** 16 else np.int32
    return {"rows": rows.astype(dtype), "lengths": np.asarray(lengths, np.int32),
            "starts": np.asarray(starts, np.int32)}


_tables: dict = {}  # id(rows) -> (rows, table, stats): the table of a loaded datastore, built once


def table_for(params, cfg: RetrievalConfig, vocab_size: int) -> tuple[NgramTable, dict]:
    """(table, build statistics) of a datastore's rows, built on first use (then kept while the rows
    live; one datastore at a time, as a table takes tens of MB)."""
    rows = params["rows"]
    hit = _tables.get(id(rows))
    if hit is not None and hit[0] is rows:
        return hit[1], hit[2]
    host = np.asarray(rows).astype(np.int64)
    if host.ndim != 2:
        raise RetrievalError(f"the datastore's rows must be [R, T], got shape {host.shape}")
    if host.size and (host.min() < 0 or host.max() >= vocab_size):
        raise RetrievalError(f"the datastore holds token ids in [{host.min()}, {host.max()}], outside the "
                             f"target's vocabulary of {vocab_size}: it was built with another tokenizer; "
                             f"rebuild it for this target (jaxdecode train retrieval --target DIR ...)")
    start = time.perf_counter()
    table, stats = build_table(host, np.asarray(params["lengths"]), np.asarray(params["starts"]),
                               max_order=cfg.max_order, ways=cfg.ways, load=cfg.load)
    stats["build_seconds"] = round(time.perf_counter() - start, 2)
    _tables.clear()
    _tables[id(rows)] = (rows, table, stats)
    return table, stats


def make_retrieval_drafter(params, cfg: RetrievalConfig, target, tree=None, temperature: float = 0.0,
                           **kw) -> RetrievalDrafter:
    """The drafter for `target` from a shipped datastore; `tree`: 'chain:N' or a node count (default
    cfg.num_nodes). Options: history_ngram, min_reach (0 turns the confidence cut off)."""
    from jaxdecode.drafters import _node_budget
    unknown = sorted(set(kw) - {"history_ngram", "min_reach"})
    if unknown:
        raise RetrievalError(f"unknown retrieval drafter options {unknown} (it takes history_ngram, "
                             f"min_reach)")
    kw.setdefault("history_ngram", cfg.history_ngram)
    kw.setdefault("min_reach", cfg.min_reach if cfg.confidence else 0.0)
    table, _ = table_for(params, cfg, target.config.vocab_size)
    return RetrievalDrafter(table=table, num_nodes=_node_budget(tree, cfg.num_nodes), confidence=cfg.confidence,
                            sampled_confidence=cfg.sampled_confidence, by_source=cfg.by_source,
                            temperature=temperature, **kw)  # checked (and made a float) by the drafter


def match_acceptance(drafter: RetrievalDrafter, prompts, continuations, max_length: int | None = None,
                     batch: int = 64) -> tuple[tuple, list]:
    """P(the target accepts a drafted token | it accepted the token's parent), by the token's winning
    match length, from a chain-by-chain walk over the target's own (greedy) continuations: rows of
    `prompts` int[R, P] continued by `continuations` int[R, C]; at each step the drafter proposes from
    the text so far, its tokens count as tried up to the first mismatch, and the walk moves on by what
    greedy verification would commit. Returns (rates per length 1..max_length, smoothed with one
    accepted and one rejected pseudo-count and made non-decreasing in the length, [tried, accepted]
    counts per length); for a `by_source` drafter 2 x max_length of each, the datastore's lengths then
    the row's own text's (each half non-decreasing). Over continuations sampled at temperature T the
    same walk measures the acceptance when sampling at T: a point-mass draft is kept with the target's
    probability of its token, the chance that the sampled text holds it, and a rejection's replacement
    is drawn as the sampled text's token given that it differs."""
    prompts, continuations = np.asarray(prompts), np.asarray(continuations)
    r, p = prompts.shape
    c = continuations.shape[1]
    max_length = max_length or max(drafter.history_ngram, drafter.table.max_order if drafter.table else 1)
    sources = 2 if drafter.by_source else 1
    counts = np.zeros((sources, max_length, 2), np.int64)
    draft = jax.jit(lambda h, n: drafter.draft(h, n, with_match=True))
    room = np.zeros((r, drafter.num_nodes + 1), np.int32)  # where the drafter writes its chain
    text = np.concatenate([prompts, continuations, room], axis=1).astype(np.int32)
    for lo in range(0, r, batch):
        rows = text[lo:lo + batch]
        done = np.zeros(len(rows), np.int64)  # continuation tokens already walked past
        while (done < c).any():
            hist = np.where(np.arange(rows.shape[1])[None, :] < (p + done)[:, None], rows, 0)
            toks, valid, strength, own = (np.asarray(x) for x in draft(jnp.asarray(hist, jnp.int32),
                                                                      jnp.asarray(p + done, jnp.int32)))
            for i in np.flatnonzero(done < c):
                a = 0
                while a < drafter.num_nodes and valid[i, a] and done[i] + a < c:
                    k = min(int(strength[i, a]), max_length) - 1
                    ok = toks[i, a] == rows[i, p + done[i] + a]
                    counts[int(own[i, a]) if sources == 2 else 0, k] += (1, int(ok))
                    if not ok:
                        break
                    a += 1
                done[i] += a + 1
    rates = np.maximum.accumulate((counts[..., 1] + 1.0) / (counts[..., 0] + 2.0), axis=1).reshape(-1)
    return tuple(round(float(x), 4) for x in rates), counts.reshape(-1, 2).tolist()


register_kind(DrafterKind(name="retrieval", config_cls=RetrievalConfig, make=make_retrieval_drafter,
                          target_fields=("vocab_size",)))
