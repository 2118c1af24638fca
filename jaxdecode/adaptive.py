"""Adaptive speculation: each step, how deep each row drafts (down to zero), from measured costs and
the rows' running acceptance.

Per row the policy keeps `accept` f32[B, D], a running estimate of a_d = P(depth d is accepted | depth
d-1 was), and `need` int32[B, D+1]: how many leading nodes of the row's latest proposal hold every node
of depth <= k (nodes are topologically ordered, so a verification over the first w nodes holds whole
paths). A step that verifies row b's depths <= k is expected to commit

    E_b(k) = 1 + sum_{d <= k} P_b(d),   P_b(d) = a_1 a_2 ... a_d      (the bonus, plus each depth reached)

tokens. A verification over width w (a node count; 0 = the pending token alone, a plain decoding
step) lets row b verify depths k_b(w) = max{k : need_b(k) <= w, P_b(k) >= min_reach}, and costs
`step[w]` (the engine's whole step, measured: jaxdecode.costmodel) plus the drafter's step. A batch
decodes until its last row is done, so the policy picks the width that finishes the batch soonest
if it were kept: step[w] * max_b remaining_b / E_b(k_b(w)), remaining_b = the row's tokens still to
go (its max_new_tokens budget; 0 once done). At batch 1 that is the most expected tokens per second;
in a batch, rows that speculate well cannot make up for one that does not (they would finish early
and wait). A drafting width must beat the plain step by `margin`. The choice is made twice a step:
  1. before drafting, from the previous proposal's `need` (`should_draft`): when the best width is 0
     the drafter does not draft (its optional `idle` keeps its state current) and every row decodes
     plainly: speculation is off for the whole batch while it does not pay;
  2. after drafting, from this proposal (`truncate`): each row keeps its nodes of depth <= k_b(w*), so
     rows differ in how many draft tokens they verify, and the forward runs over the smallest width
     that holds them.

Lossless: which nodes are kept depends on past acceptance and on the tree's *shape* — never on this
step's sampled tokens: when sampling, `need` comes from the tree's fixed structure (`shape`
"structure"), or the width is all or nothing ("none") for trees whose shape follows their tokens;
only greedy decoding reads it from the proposal's valid nodes ("proposal"). Dropping whole deeper levels leaves a tree drafted by the same child rule, so every
verifier's guarantee holds for what is verified.

Estimates: a depth tried this step (the node committed above it had a kept child) moves toward 1 if
committed, else 0 (weight 1 - decay); an untried depth drifts by `explore` toward the estimate of the
depth above it (depth 1: toward `prior`), so a row that stopped speculating probes again now and
then, and a drafter that is always right grows its depth until the cost says stop.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.tree import depths


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    """Static configuration of adaptive speculation (hashable: part of the jit key)."""
    widths: tuple  # ascending verify widths, widths[0] == 0 (plain step), widths[-1] == N
    decay: float = 0.8  # weight of the past in a tried depth's estimate
    prior: float = 0.6  # every depth's estimate before evidence
    explore: float = 0.005  # per-step drift of an untried depth's estimate (see `update`)
    min_reach: float = 0.02  # a row verifies depth d only while P_b(d) >= this
    # A width that drafts must beat the plain step's tokens per second by this fraction: measured costs
    # carry noise, and a tie must not buy a slowdown.
    margin: float = 0.15
    # Where `need` comes from: "proposal" (the proposed valid nodes: greedy decoding), "structure" (the
    # tree's parents, validity ignored: sampling with a fixed shape), "none" (all nodes or none:
    # sampling with a shape that follows the sampled tokens). See the module docstring.
    shape: str = "proposal"

    def __post_init__(self):
        ws = tuple(int(w) for w in self.widths)
        if not ws or ws[0] != 0 or list(ws) != sorted(set(ws)):
            raise ValueError(f"adaptive widths must be ascending node counts starting at 0, got {self.widths}")
        for name in ("decay", "prior", "explore", "min_reach", "margin"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"AdaptivePolicy.{name} must lie in [0, 1], got {v}")
        if self.shape not in ("proposal", "structure", "none"):
            raise ValueError(f"AdaptivePolicy.shape must be 'proposal', 'structure' or 'none', got {self.shape!r}")
        object.__setattr__(self, "widths", ws)


def default_widths(num_nodes: int, extra=()) -> tuple:
    """0, powers of two below N, N, and any widths the drafter declares (`verify_widths`)."""
    ws = {0, num_nodes} | {w for w in (2 ** i for i in range(int(np.log2(max(num_nodes, 1))) + 1))
                           if w < num_nodes}
    ws |= {int(w) for w in (extra or ()) if 0 < int(w) <= num_nodes}
    return tuple(sorted(ws))


def cost_vector(policy: AdaptivePolicy, costs) -> jnp.ndarray:
    """f32[W + 2]: seconds of an engine step per policy width with drafting excluded (the table's
    `step_at`: the forward, the verifier, the commit, ...), then the drafter's propose and idle seconds.
    `costs`: a jaxdecode.costmodel.CostTable (anything with step_at or verify_at / draft_seconds /
    idle_seconds)."""
    at = getattr(costs, "step_at", None) or costs.verify_at
    # A wider verification never costs less than a narrower one: a table measured under noise (other
    # jobs on the machine) is made monotone, so noise cannot make a wide tree look free.
    verify = np.maximum.accumulate([float(at(w)) for w in policy.widths]).tolist()
    vec = np.asarray(verify + [float(costs.draft_seconds), float(getattr(costs, "idle_seconds", 0.0))],
                     np.float32)
    if not np.all(np.isfinite(vec)) or np.any(vec < 0) or vec[0] <= 0:
        raise ValueError(f"the cost table gives unusable seconds {vec.tolist()} (need finite, >= 0, and a "
                         f"plain step > 0): re-measure it (jaxdecode calibrate --refresh)")
    return jnp.asarray(vec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyState:
    accept: jax.Array  # f32[B, D]: estimate of P(depth d accepted | depth d-1 accepted)
    need: jax.Array  # int32[B, D+1]: leading nodes holding depths <= k in the latest proposal
    max_depth: jax.Array  # int32[B]: deepest valid node of the latest proposal


def init_state(policy: AdaptivePolicy, batch: int, max_depth: int, num_nodes: int, static_parents=None):
    """Estimates at the prior; `need` from the drafter's static shape when it has one, else spread evenly."""
    if static_parents is not None:
        parents = np.asarray(static_parents)
        d = np.zeros(len(parents), np.int64)
        for i, p in enumerate(parents):  # host side, once: parents[i] < i
            d[i] = 1 if p < 0 else d[p] + 1
        need = np.array([int(np.max(np.where(d <= k, np.arange(len(d)) + 1, 0))) for k in range(max_depth + 1)])
    else:
        need = np.minimum(np.ceil(np.arange(max_depth + 1) * num_nodes / max(max_depth, 1)), num_nodes)
    return PolicyState(accept=jnp.full((batch, max_depth), policy.prior, jnp.float32),
                       need=jnp.broadcast_to(jnp.asarray(need, jnp.int32), (batch, max_depth + 1)),
                       max_depth=jnp.full((batch,), max_depth, jnp.int32))


def _reach(accept):
    """P_b(d) for d = 0..D: f32[B, D+1] (P_b(0) = 1)."""
    return jnp.concatenate([jnp.ones_like(accept[:, :1]), jnp.cumprod(accept, axis=1)], axis=1)


def _best_width(policy, state: PolicyState, costs, remaining, drafted: bool):
    """(index of the best width, depth per row at each width int32[W, B]). remaining: int32[B], the
    tokens each row still has to go (0: done)."""
    active = remaining > 0
    reach = _reach(state.accept)  # [B, D+1]
    expected = jnp.cumsum(reach, axis=1)  # E_b(k) = 1 + sum_{d<=k} P_b(d): [B, D+1]
    k = jnp.arange(reach.shape[1])[None, :]
    ok = (reach >= policy.min_reach) & (k <= state.max_depth[:, None])  # prefix-closed in k
    widths = jnp.asarray(policy.widths, jnp.int32)  # [W]
    fits = ok[None] & (state.need[None] <= widths[:, None, None])  # [W, B, D+1]
    depth = jnp.sum(fits[:, :, 1:], axis=2).astype(jnp.int32)  # [W, B]: fits is prefix-closed too
    gain = jnp.take_along_axis(expected[None], depth[..., None], axis=2)[..., 0]  # [W, B]: E_b at each width
    # Tokens past a row's budget are dropped: a row with r tokens to go gains at most r (its last
    # token needs one step however deep it drafts).
    gain = jnp.minimum(gain, jnp.maximum(remaining, 1)[None].astype(jnp.float32))
    steps_left = jnp.max(jnp.where(active[None], remaining[None].astype(jnp.float32) / gain, 0.0), axis=1)  # [W]
    w = len(policy.widths)
    verify, draft, idle = costs[:w], costs[w], costs[w + 1]
    step = verify + jnp.where(drafted | (widths > 0), draft, idle)
    finish = step * steps_left * jnp.where(widths > 0, 1.0 + policy.margin, 1.0)  # seconds to finish the batch
    return jnp.argmin(finish), depth


def should_draft(policy: AdaptivePolicy, state: PolicyState, costs, remaining):
    """bool[]: does drafting pay this step (judged on the previous proposal's shape)? remaining:
    int32[B], tokens each row still has to go (0: done)."""
    best, _ = _best_width(policy, state, costs, remaining, drafted=False)
    return best > 0


def truncate(policy: AdaptivePolicy, state: PolicyState, costs, tree, remaining):
    """Keep each row's nodes of depth <= its chosen depth: (tree, depth int32[B], state with this
    proposal's shape). remaining: as in `should_draft`."""
    active = remaining > 0
    n = tree.tokens.shape[1]
    d_max = state.need.shape[1] - 1
    node_depth = depths(tree.parents)  # [B, N]
    valid = tree.valid
    shaped = valid if policy.shape == "proposal" else jnp.ones_like(valid)  # "structure": parents only
    if policy.shape == "none":  # the shape follows the sampled tokens: all nodes or none
        need = jnp.where(jnp.arange(d_max + 1)[None, :] > 0, n, 0).astype(jnp.int32)
        need = jnp.broadcast_to(need, (valid.shape[0], d_max + 1))
        deepest = jnp.full((valid.shape[0],), d_max, jnp.int32)
    else:
        k = jnp.arange(d_max + 1)
        inside = shaped[:, :, None] & (node_depth[:, :, None] <= k[None, None, :])  # [B, N, D+1]
        need = jnp.max(jnp.where(inside, jnp.arange(1, n + 1)[None, :, None], 0), axis=1).astype(jnp.int32)
        deepest = jnp.max(jnp.where(shaped, node_depth, 0), axis=1).astype(jnp.int32)
    # A row whose proposal is empty this step (e.g. no n-gram match) says nothing about the shape of
    # its next one: keep its last shape, or it would judge every later step undraftable and stop.
    has = jnp.any(valid, axis=1)
    state = dataclasses.replace(state, need=jnp.where(has[:, None], need, state.need),
                                max_depth=jnp.where(has, deepest, state.max_depth))
    best, depth_at = _best_width(policy, state, costs, remaining, drafted=True)
    depth = depth_at[best]
    tree = tree.replace(valid=valid & (node_depth <= depth[:, None]) & active[:, None])
    return tree, depth, state


def update(policy: AdaptivePolicy, state: PolicyState, tried, accepted, active):
    """Fold one verification's per-row outcome (tried / accepted bool[B, D]) into the estimates."""
    a = state.accept
    seen = policy.decay * a + (1.0 - policy.decay) * accepted.astype(jnp.float32)
    # Untried depths drift up: depth 1 toward 1 (optimism: a row that stopped drafting probes again
    # once its estimate crosses what pays; the cheaper the draft, the sooner, and the cheaper the probe),
    # a deeper one toward the depth above (a drafter that is always right grows its depth).
    above = jnp.concatenate([jnp.ones_like(a[:, :1]), a[:, :-1]], axis=1)
    drift = a + policy.explore * (above - a)
    new = jnp.where(tried, seen, drift)
    return dataclasses.replace(state, accept=jnp.where(active[:, None], new, a))
