"""Adaptive speculation: each step, which draft nodes each row verifies (down to none), from measured
costs and the rows' running acceptance.

Per row the policy keeps `accept` f32[B, K], a running estimate per node *key* of c_k = P(a node of
key k is accepted | its parent was and its earlier siblings were not). A key names the same draft
position from step to step: for a drafter with a static tree (or a chain) the node itself (node i
always has the same path of sibling ranks); for a tree whose shape changes (EAGLE-2, ...) the pair
(depth, sibling rank). At most one child of a node is accepted, so node i is accepted given its parent
with a_i = c_key(i) * prod_{earlier siblings j} (1 - c_key(j)) (siblings' a sum to <= 1, and a first
child that keeps missing leaves its mass to the next), and its reach is the product along its path,
P_b(i) = prod_{j on root..i} a_j. A step that verifies the node set S of row b is expected to commit

    E_b(S) = 1 + sum_{i in S} P_b(i)      (the bonus, plus each node reached: accepted nodes form one path)

tokens. For a verification over width w (a node count; 0 = the pending token alone, a plain
decoding step) each row keeps its w nodes of highest reach (`_node_values`): the set is closed under
parents (reach never grows along a path; ties go to the parent, the lower index) and under earlier
siblings (a node is ranked no higher than its previous sibling), so every kept node's children are
its first children by rank. A width costs `step[w]` (the engine's whole step, measured:
jaxdecode.costmodel) plus the drafter's step. A batch decodes until its last row is done, so the
policy picks the width that finishes the batch soonest if it were kept:
step[w] * max_b remaining_b / E_b(w), remaining_b = the row's tokens still to go (0 once done). At
batch 1 that is the most expected tokens per second; in a batch, rows that speculate well cannot
make up for one that does not. A drafting width must beat the plain step by `margin`. The choice is
made twice a step:
  1. before drafting, from the previous proposal's shape (`should_draft`): when the best width is 0
     the drafter does not draft (its optional `idle` keeps its state current) and every row decodes
     plainly: speculation is off for the whole batch while it does not pay;
  2. after drafting, from this proposal (`truncate`): each row keeps its best nodes for the chosen
     width. The kept nodes are usually not the first nodes of the tree (a wide tree's best chain is
     nodes 0, 4, 12, ... of `static:4,2,2,1`), so `compact` gathers them into the first slots
     (parents remapped, topological order kept) and the forward runs over the smallest width that
     holds them; `expand` maps the verdict back to the drafter's node indices.

Lossless: which nodes are kept depends on past acceptance and on the tree's *shape* — never on this
step's sampled tokens: when sampling, the shape comes from the tree's fixed structure (`shape`
"structure"), or the width is all or nothing, judged on the previous proposal ("none"), for trees
whose shape follows their tokens; only decoding greedily or with children that are a function of
the past (top-k, point masses) reads it from the proposal's valid nodes ("proposal"). What is kept is
then a tree drafted by the same child rule with fewer nodes, for every rule of
jaxdecode.verifiers.CHILD_RULES: "point" / "argmax" / "topk" children are a function of the past, any
sub-tree of them is too; "iid" / "sample" siblings are independent draws, and a subset chosen without
looking at them is still i.i.d.; "gumbel" siblings are a draw without replacement in draw order, and
its first m (the kept siblings are always the first by rank) are a draw of m without replacement.
Chain verifiers see a prefix of the chain; GBV ("paths") sees the first K' paths, which it truncates
to the shortest kept one, as it does any proposal.

Estimates start at `prior`, or per depth at `prior_by_depth`: a trained drafter declares its held-out
acceptance by depth (`acceptance_prior`, measured under greedy verification), which `policy_for` uses
when decoding greedily, so a drafter that is good enough to pay is tried from the first step rather
than judged at a flat prior it may never climb out of.

Measured priors. A running estimate weighs each observation 1 - decay: it counts as 1 / (1 - decay)
observations (5), and a flat prior, a guess, is worth no more. A drafter's measured acceptance is worth
more: the embedded draft LM's 0.79 at depth 1 fell to 0.40 after three misses, and at batch 3, where
two of the three openings reject its first drafts, the batch stopped drafting for good (0.86x plain
greedy, the fixed chain 1.03x). Such a prior (by depth, or a class-keyed drafter's by class) counts
as `prior_weight` observations (`policy_for`: MEASURED_PRIOR_WEIGHT, 16): a key's weight n takes an
observation at 1 / (decay * n + 1) and becomes decay * n + 1, which falls toward the steady
1 / (1 - decay) within ~10 observations; the estimate is then the running one. Three misses now leave
0.61.

Later siblings. Both priors are a first child's rate (a flat guess, or acceptance measured along a
chain); a later sibling (rank r >= 1) starts at c = `sibling_share` (1/3), as a guess (1 / (1 - decay)
observations) even where the first child's start is measured. Estimates that were each P(accepted |
parent) and started every rank at the depth's prior made Medusa's four depth-1 siblings 0.68 each
(capped so that siblings summed to 1: the first two covered the whole depth), a 44-node tree looked
worth 1 + depth tokens, and the policy drafted it at 0.72x plain greedy. Measured (greedy, fixed full
trees, 16 held-out prompts x 96 tokens), ranks 0-3 at depth 1 are accepted given the parent
0.43 / 0.12 / 0.07 / 0.03 (Medusa), 0.55 / 0.14 / 0.07 / 0.03 (Hydra), 0.73 / 0.15 / 0.06 / 0.02
(EAGLE-3): given the earlier ranks missed, c = 0.22 / 0.16 / 0.08, 0.32 / 0.21 / 0.14 and
0.57 / 0.50 / 0.28 for ranks 1-3, around the guess of 1/3.

Confidence classes. A drafter whose every node comes with a confidence of its own, a function of the
past (the retrieval drafter: the length of the match a token was retrieved on), declares
`confidence_classes` C and labels its nodes (Tree.classes); `policy_for` then keys the estimates by class
(`AdaptivePolicy.classes`): a_c = P(a node of class c is accepted | its parent was), per row, started
at the drafter's own measurement (`class_prior`; when sampling, `class_prior_at` the temperature: a
point-mass draft is kept with the target's probability of its token, so greedy rates overstate it).
A position says little about such a drafter's next token (a strong match at depth 5 beats a weak one
at depth 1), its class does. Before drafting the
next proposal's classes are unknown, so the plan judges the previous shape as if every node were of
the best class (drafting is a lookup: proposing costs next to nothing); after drafting, `truncate`
keeps each row's nodes by this proposal's classes. A key tried this step (a kept node whose
parent was committed, or a kept child of the root, and none of whose earlier siblings was) moves
toward 1 if its node was committed, else 0 (weight 1 - decay); an untried key drifts by `explore`
(times the batch's `explore_scale`, "Returns to drafting") toward the estimate of the key above it
(its parent node; depth 1: toward 1), so a row that stopped speculating probes again now and then, and
a drafter that is always right grows its tree until the cost says stop.

Shape probes. Estimates drift back toward trying, but the plan also judges the last proposal's shape
(shape "proposal"), and that does not drift: a lookup drafter whose last proposal was a one-node weak
match would be judged on one node for good, which never pays where a drafting step costs 2.5 plain
steps (a GPU running a small target), and the row would never draft again. So a row that has waited
long enough since its last proposal is judged on the drafter's full shape instead (its first
proposal's guess, above): the plan drafts, and `truncate` keeps what this proposal's real nodes are
worth (maybe nothing: the row then decodes plainly, having paid one draft). The wait starts at
`probe_first` steps and doubles after each proposal whose shape does not pay, up to `probe_period`
(at least `probe_every`; longer when a draft is dear, so that failed probes cost at most `probe_cost`
of the time); a shape that pays resets it. Measured with the H200's cost table (a drafting step 2.7
plain steps), probes took the retrieval default from never drafting after its first weak match (0.82x
plain greedy) to 1.39x, measured with a fixed 21-step wait (BENCHMARKS.md, "On a GPU").
An empty proposal (no match) is a probe that failed when the row was due one; from a row drafting on a
shape that pays, it stops the row, which probes after 1 step, then 2, 4, ... up to `probe_period`
while probes come back empty. Keyed by class, a proposal that does not pay at its own classes (a weak
match) counts as empty: the plan judges a recorded shape at the best class and would draft it again
next step, only to keep nothing. A plain stretch between probes runs as one lean run (`plain_run_length`
finds the step at which the plan would draft), not as an engine step per token.

First looks. A drafter with no measured acceptance starts every key at the flat guess `prior` (0.6),
and where a drafting step is dear next to a plain one (a small model, where the engine's fixed costs
weigh) no width may pay at 0.6: the plan never drafts, no key is ever tried, and the estimates only
drift, too slowly to matter. A user's tiny model with prompt lookup, whose output repeated itself (the
fixed chain verified 8 of 8 drafts every step, 1.9x plain greedy), decoded all 128 tokens plainly. So
a key that started at the guess and was never tried (`never_tried`) is judged on a row's shape probe
as if always accepted: the plan drafts the shape and `truncate` keeps it. The verdict then weighs
against the guess as one observation against another (weight 1 / (1 + decay), not 1 - decay): an
always-right chain moves 0.6 -> 0.82 at every depth and pays from then on; a wrong one falls to 0.27.
A look that finds nothing costs its draft and a step at its width in place of a plain one, and a row
looks only as deep as that costs at most `probe_cost` (2%) of its plain steps to go; keys below that
depth are judged never accepted on the look (EAGLE-3 sampled at T = 0.7 on the CPU, 128 new tokens,
lost 2% to whole-chain looks at 5%: a draft level costs half a plain step there). A batch drafts when
its slowest row pays, so the rows that have never-tried keys look together, on one step, or not at all
(looks row by row, at a 5% budget, cost the embedded target with prompt lookup 3-6% at batch 4 and
16). And there one row's miss would hold every row plain (some row always misses at batch 16; a tiny
model's batch of 2 decoded plainly after one unlucky row), so in a batch a miss leaves the row's guess
as it was and a row looks once. Decoding one row, later looks at deeper keys (a short match leaves them
untried) are worth their cost: prompt lookup on the embedded target's greedy text from outside its
corpus ran 10% faster with them. Measured priors (by depth or by class) and later siblings have nothing
to look at. `first_look=False` turns it off.

Batch spread. A row's tokens per step are random (K accepted nodes, then the bonus), so at a given
width its steps to go are r / E_b, give or take sqrt(r Var K / E_b^3), and the batch waits for the
row that was unluckiest: E[max_b steps_b] exceeds max_b E[steps_b] by about the spread times the
expected maximum of n standard normals (0.56 for 2 level rows, 1.03 for 4, 1.77 for 16), n the rows
that contest the maximum (within two spreads of the slowest mean). With `batch_spread` > 0 the plan
prices each row's steps so (that many times the term; Var K from the kept nodes' reach and depth,
exact for trees); within a step of a simulated batch (benchmarks/bench_batch_spread.py). It is off
by default: on the CPU grid (retrieval default, batch 4 and 16, T = 0 and 0.7, two processes) it
drafted less and was not faster on the whole (better in one process, worse in the other; the 15%
margin, tuned under the max of the means, already buys that caution; BENCHMARKS.md, "Batch spread").
At batch 1, and for a row judged alone (probes), there is no spread either way.

Batch backoff. A batch drafts only when its plan pays for the slowest row, and a row whose proposal
came back empty probes again one step later. In a large batch the rows miss in turn, so some row was
always due and the plan drafted on step after step, kept nothing (the one empty row needs a step per
token) and cut the lean runs short: the retrieval default sampling 64 tokens at batch 16 (held-out
prompts) took 23 drafting steps that kept nothing, 18 with the hold. So a drafting step that keeps
nothing for the whole batch holds the batch plain for `hold` steps, 1, then 2, 4, ... up to
`probe_period`; a step that keeps a node ends it. At batch 1 the hold is the row's own wait.

Returns to drafting. The estimates drift back toward trying at the same rate whatever a try costs and
however tries have paid. A drafter whose state lags (a draft LM, EAGLE-3, self-speculation:
`Drafter.catch_up_lag`) first runs over every token committed since its last proposal: a steady step
leaves it at most max_depth + 1 behind, which the measured step prices, but after a lean plain run of
up to `plain_run` tokens the first drafting step pays for the whole run again (the table's
`catch_up_seconds` per token; the embedded draft LM on the CPU: 5.6 ms after 32 plain tokens, 1.8
plain steps). So each drafting step that follows a plain one is scored when it is verified: the plain
steps it saved, the mean tokens it committed per live row less its cost in plain steps (the engine
step at the width verified, the draft, the catch-up of the row furthest behind). `payoff` is their
running mean (weight 1 - decay). After a return whose running mean is below 0 the batch drifts at
half its rate (`explore_scale`, down to `explore_floor`); after one at or above 0, at twice (up to
1). A drafter whose returns keep losing tries ever more rarely: the embedded draft LM (~3.3 tokens for
~4.1 plain steps) went from 6.5 to 3.9 drafting steps per 128 tokens on the CPU, 0.970x -> 0.988x
plain greedy (never drafting: 0.992x). One whose returns pay on the whole though most fail keeps
about its rate: EAGLE-3 (a few accepted deep) 11.5 -> 10.8, 0.93x -> 0.95x. Pricing the catch-up in
the plan instead cut both drafters' tries alike, and EAGLE-3 lost 4% (BENCHMARKS.md, "Returns to
drafting" and "Pricing a drafter's catch-up").

Sampling margin. When sampling, a drafting width must beat the plain step by SAMPLING_MARGIN (0.3),
not the greedy `margin` (0.15): each row's draft is then accepted by a coin flip, and a batch waits
for its unluckiest row, so the realised gain falls short of the mean the plan prices; and the rates a
drafter may declare at a temperature were measured on its own training text. On the CPU the retrieval
default at T = 0.7 drafted width-1 steps that lost: 0.93-0.97x plain sampling at batch 4, where never
drafting ran 0.99-1.05x. With 0.3 it measured 1.05x / 1.01x, 0.99x / 0.97x and 1.03x / 1.05x at batch
1 / 4 / 16 (held-out / outside; the same run: 1.04x / 0.98x, 0.95x / 0.93x, 0.99x / 1.01x), keeping
the drafts that pay at batch 1 (BENCHMARKS.md, "A wider margin when sampling"). A batch of several
rows sampling asks SAMPLING_BATCH_MARGIN (0.5, `batch_margin`): in a batch of level rows (every row has
the same tokens to go) the batch is a step shorter only when all the rows that hold it back accept, and
the width-1 steps drafted at 0.3 at batch 4, T = 0.7 (62 of 504 trips) saved 8 trips, 0.13 a drafting
step against the 0.47 or more the plan priced: 0.94-0.96x plain sampling held-out in four runs (0.98x
outside in three), where 0.5 drafted on 0-1 steps and ran 0.97-1.05x (BENCHMARKS.md, "A wider margin for
a sampled batch"). `speculative.policy_for` sets both; a policy option `margin` given explicitly holds
at every batch size (`batch_margin` None), and a `batch_margin` given explicitly wins.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.tree import Tree, depths

SAMPLING_MARGIN = 0.3  # AdaptivePolicy.margin when sampling ("Sampling margin")
SAMPLING_BATCH_MARGIN = 0.5  # AdaptivePolicy.batch_margin when sampling (ibid.)
MEASURED_PRIOR_WEIGHT = 16.0  # observations a drafter's measured acceptance counts as ("Measured priors")
MAX_RANK_KEYS = 16  # sibling ranks told apart in a changing tree's (depth, rank) keys; later ones share


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    """Static configuration of adaptive speculation (hashable: part of the jit key)."""
    widths: tuple  # ascending verify widths, widths[0] == 0 (plain step), widths[-1] == N
    decay: float = 0.8  # weight of the past in a tried key's estimate
    prior: float = 0.6  # every key's estimate before evidence
    explore: float = 0.005  # per-step drift of an untried key's estimate (see `update`)
    # The least fraction of `explore` a batch drifts at once its returns to drafting stop paying (see
    # "Returns to drafting"); 1.0: always the full rate.
    explore_floor: float = 1.0 / 64.0
    min_reach: float = 0.02  # a row verifies node i only while its reach P_b(i) >= this
    # A width that drafts must beat the plain step's tokens per second by this fraction: measured costs
    # carry noise, and a tie must not buy a slowdown (policy_for: SAMPLING_MARGIN when sampling).
    margin: float = 0.15
    # The margin for a batch of more than one row; None: `margin` (policy_for: SAMPLING_BATCH_MARGIN when
    # sampling, "Sampling margin").
    batch_margin: float | None = None
    # Where the shape comes from: "proposal" (the proposed valid nodes: greedy decoding), "structure"
    # (the tree's parents, validity ignored: sampling with a fixed shape), "none" (all nodes or none,
    # judged on the previous proposal: sampling with a shape that follows the sampled tokens). See the
    # module docstring.
    shape: str = "proposal"
    # Per-depth starting estimates (depth 1, 2, ...; deeper keys take the last), in place of `prior`: a
    # trained drafter's held-out acceptance (its `acceptance_prior`). Without it a good drafter can
    # look too weak to try at the flat prior, and a row that never drafts never learns otherwise.
    prior_by_depth: tuple = ()
    # Observations the starting estimates count as (see "Measured priors"): 0 = as many as a running
    # estimate holds, 1 / (1 - decay); more for a prior measured over many held-out tokens, so that a
    # few early misses do not wipe it out.
    prior_weight: float = 0.0
    # Keys by the drafter's confidence class (Tree.classes) instead of by position: C > 0 classes, the
    # estimate of class c starting at prior_by_class[c] (the last entry for later classes; () = prior).
    # Only with shape "proposal" (the classes are read from the proposal). See "Confidence classes".
    classes: int = 0
    prior_by_class: tuple = ()
    # Shape probes (shape "proposal"): a row's plan judges the shape of its last proposal, and a short
    # one (a weak n-gram match) may never pay, so the row would never draft again and never see a longer
    # one. A row whose last proposal did not pay is judged on the drafter's full shape once it has
    # waited `probe_first` steps, twice as long after each further proposal that does not pay, up to
    # `probe_every` steps or more when the draft is dear (so probes cost at most `probe_cost` of the
    # plain steps: draft / (probe_cost * plain step)). See "Shape probes".
    probe_first: int = 8
    probe_every: int = 8
    probe_cost: float = 0.02
    # The most plain steps the engine takes in a row once drafting does not pay: a lean inner loop
    # (forward, next token, commit one token; the drafter's idle and observe only where it is not
    # `history_only`) without the proposal, verifier and per-step policy bookkeeping, which cost 5-15% of
    # a plain step of a small model. A run stops where the drifting estimates would make the policy probe
    # again (plain_run_length), so probes come when they would step by step. 1: one engine step at a time.
    plain_run: int = 32
    # A later sibling's (rank >= 1) start, P(accepted | parent accepted, earlier siblings missed): the
    # priors (flat, or a drafter's measured acceptance by depth) are a first child's. See "Later siblings".
    sibling_share: float = 1.0 / 3.0
    # Keys started at the flat `prior` (no measured one) that were never tried are judged on a shape probe
    # as if always accepted, to the depth at which a look that finds nothing costs at most `probe_cost`
    # of the row's plain steps to go; the verdict there outweighs the guess. A batch's rows look together,
    # once, and a miss there leaves the guess. See "First looks".
    first_look: bool = True
    # A batch's steps are its slowest row's, and rows accept at random: > 0 prices E[max over rows] as
    # each row's mean steps plus this many times its spread times E[max of n normals] (n: the rows
    # contesting the maximum). 0 (default): the max of the means. See "Batch spread".
    batch_spread: float = 0.0

    def __post_init__(self):
        ws = tuple(int(w) for w in self.widths)
        if not ws or ws[0] != 0 or list(ws) != sorted(set(ws)):
            raise ValueError(f"adaptive widths must be ascending node counts starting at 0, got {self.widths}")
        for name in ("probe_first", "probe_every", "plain_run"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AdaptivePolicy.{name} must be an int >= 1, got {v!r}")
        if self.probe_first > self.probe_every:
            raise ValueError(f"AdaptivePolicy.probe_first ({self.probe_first}) must not exceed probe_every "
                             f"({self.probe_every}): the first wait is the shortest")
        if not isinstance(self.first_look, bool):
            raise ValueError(f"AdaptivePolicy.first_look must be a bool, got {self.first_look!r}")
        if isinstance(self.batch_spread, bool) or not (isinstance(self.batch_spread, (int, float))
                                                       and 0.0 <= self.batch_spread < np.inf):
            raise ValueError(f"AdaptivePolicy.batch_spread must be a finite number >= 0, got {self.batch_spread!r}")
        if not 0.0 < self.probe_cost <= 1.0:
            raise ValueError(f"AdaptivePolicy.probe_cost must lie in (0, 1], got {self.probe_cost}")
        if not (isinstance(self.prior_weight, (int, float)) and np.isfinite(self.prior_weight)
                and self.prior_weight >= 0):
            raise ValueError(f"AdaptivePolicy.prior_weight (observations the prior counts as) must be a finite "
                             f"number >= 0, got {self.prior_weight!r}")
        for name in ("decay", "prior", "explore", "min_reach", "margin", "sibling_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"AdaptivePolicy.{name} must lie in [0, 1], got {v}")
        if self.batch_margin is not None and (isinstance(self.batch_margin, bool) or not isinstance(
                self.batch_margin, (int, float)) or not 0.0 <= self.batch_margin <= 1.0):
            raise ValueError(f"AdaptivePolicy.batch_margin must be None (the margin) or lie in [0, 1], got "
                             f"{self.batch_margin!r}")
        if not 0.0 < self.explore_floor <= 1.0:
            raise ValueError(f"AdaptivePolicy.explore_floor must lie in (0, 1], got {self.explore_floor}")
        prior = tuple(float(a) for a in self.prior_by_depth)
        if not all(0.0 <= a <= 1.0 for a in prior):
            raise ValueError(f"AdaptivePolicy.prior_by_depth must hold acceptance rates in [0, 1], got "
                             f"{self.prior_by_depth}")
        object.__setattr__(self, "prior_by_depth", prior)
        if self.shape not in ("proposal", "structure", "none"):
            raise ValueError(f"AdaptivePolicy.shape must be 'proposal', 'structure' or 'none', got {self.shape!r}")
        if isinstance(self.classes, bool) or not isinstance(self.classes, int) or self.classes < 0:
            raise ValueError(f"AdaptivePolicy.classes must be an int >= 0, got {self.classes!r}")
        if self.classes and self.shape != "proposal":
            raise ValueError("AdaptivePolicy.classes reads each proposal's classes: it needs shape='proposal' "
                             "(proposals that are a function of the past)")
        by_class = tuple(float(a) for a in self.prior_by_class)
        if not all(0.0 <= a <= 1.0 for a in by_class) or (by_class and not self.classes):
            raise ValueError(f"AdaptivePolicy.prior_by_class must hold acceptance rates in [0, 1], with classes > 0, "
                             f"got {self.prior_by_class} (classes={self.classes})")
        object.__setattr__(self, "prior_by_class", by_class)
        object.__setattr__(self, "widths", ws)


def default_widths(num_nodes: int, extra=()) -> tuple:
    """0, powers of two below N, N, and any widths the drafter declares (`verify_widths`)."""
    ws = {0, num_nodes} | {w for w in (2 ** i for i in range(int(np.log2(max(num_nodes, 1))) + 1))
                           if w < num_nodes}
    ws |= {int(w) for w in (extra or ()) if 0 < int(w) <= num_nodes}
    return tuple(sorted(ws))


def isotonic(values) -> np.ndarray:
    """The non-decreasing sequence nearest `values` in least squares (pool adjacent violators): a run
    that decreases is replaced by its mean."""
    blocks: list = []  # [sum, count] of pooled runs, each mean above the previous one
    for v in map(float, values):
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.asarray([s / c for s, c in blocks for _ in range(c)], np.float64)


def cost_vector(policy: AdaptivePolicy, costs) -> jnp.ndarray:
    """f32[2W + 2]: seconds of an engine step per policy width with drafting excluded (the table's
    `step_at`: the forward, the verifier, the commit, ...), then the drafter's propose seconds per
    width (entry 0: the whole proposal; a `level_capped` drafter's draft of w nodes costs the table's
    `draft_at(w)`, any other drafter's its whole proposal at every width), then its idle seconds, then
    its catch-up seconds per token beyond a steady step's (the table's `catch_up_seconds`; 0 without).
    `costs`: a jaxdecode.costmodel.CostTable (anything with step_at or verify_at / draft_seconds /
    idle_seconds, and optionally draft_at)."""
    at = getattr(costs, "step_at", None) or costs.verify_at
    # A wider verification never costs less than a narrower one: a table measured under noise (other
    # jobs on the machine) is made monotone, so noise cannot make a wide tree look free. The drafting
    # widths get the least-squares monotone fit (a running maximum let one slow spell at 3 nodes price
    # every wider tree at it), and none costs less than the plain step. Likewise a deeper capped draft
    # never costs less than a shallower one.
    plain, *wider = [float(at(w)) for w in policy.widths]
    verify = [plain] + np.maximum(isotonic(wider), plain).tolist()
    full = float(costs.draft_seconds)
    draft_at = getattr(costs, "draft_at", None)
    draft = [full] + ([float(draft_at(w)) for w in policy.widths[1:]] if draft_at else [full] * (len(verify) - 1))
    draft = [draft[0]] + isotonic(draft[1:]).tolist()
    vec = np.asarray(verify + draft + [float(getattr(costs, "idle_seconds", 0.0)),
                                       float(getattr(costs, "catch_up_seconds", 0.0))], np.float32)
    if not np.all(np.isfinite(vec)) or np.any(vec < 0) or vec[0] <= 0:
        raise ValueError(f"the cost table gives unusable seconds {vec.tolist()} (need finite, >= 0, and a "
                         f"plain step > 0): re-measure it (jaxdecode calibrate --refresh)")
    return jnp.asarray(vec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyState:
    accept: jax.Array  # f32[B, K]: estimate of P(a node of key k accepted | its parent accepted)
    weight: jax.Array  # f32[B, K]: observations the estimate counts as (see "Measured priors")
    above: jax.Array  # int32[K]: the key an untried key's estimate drifts toward (-1: toward 1)
    parents: jax.Array  # int32[B, N]: the latest proposal's shape (parents) ...
    shaped: jax.Array  # bool[B, N]: ... and its nodes (the valid ones, or all of a fixed structure)
    node_classes: jax.Array  # int32[B, N]: ... and their confidence classes (class-keyed policies; else 0)
    stale: jax.Array  # int32[B]: steps since the row's shape was recorded (a proposal with a node)
    wait: jax.Array  # int32[B]: the steps after which the row's plan judges the full shape (a probe)
    full_parents: jax.Array  # int32[N]: the drafter's full shape, which a shape probe judges ...
    full_shaped: jax.Array  # bool[N]: ... and its nodes
    key_depth: jax.Array  # int32[K]: each key's depth (a class key's: max_depth, its nodes lie at any)
    nodes_to_depth: jax.Array  # int32[D]: the full shape's nodes down to depth d + 1 (a look's size)
    hold: jax.Array  # int32[]: plain steps the batch takes before it may draft again (see "Batch backoff")
    backoff: jax.Array  # int32[]: the hold after the next drafting step that keeps nothing
    streak: jax.Array  # int32[]: drafting steps since the batch's last plain step (see "Returns to drafting")
    payoff: jax.Array  # f32[]: running mean of the plain steps each return to drafting saved (< 0: lost)
    explore_scale: jax.Array  # f32[]: the fraction of `explore` the estimates drift at, from `payoff`
    never_tried: jax.Array  # bool[B, K]: a key started at the flat guess and never tried (see "First looks")
    looking: jax.Array  # bool[B]: the row's step verifies a first look (set by `truncate`, read by `update`)
    # 0: keys are node indices (a fixed structure); R > 0: key = (depth - 1) * R + min(sibling rank, R - 1).
    ranks: int = dataclasses.field(default=0, metadata=dict(static=True))
    depth: int = dataclasses.field(default=1, metadata=dict(static=True))  # the drafter's max_depth
    classes: int = dataclasses.field(default=0, metadata=dict(static=True))  # C > 0: key = the node's class


def init_state(policy: AdaptivePolicy, batch: int, max_depth: int, num_nodes: int, static_parents=None,
               is_chain: bool = False) -> PolicyState:
    """Estimates at the prior (by key depth with `prior_by_depth`). A drafter with a static shape
    (`static_parents`, [N]) gets one key per node and that shape; any other gets (depth, sibling rank)
    keys (depth alone for chains) and, until its first proposal, a guessed shape: a chain of max_depth
    nodes for chain drafters, else a binary tree in level order (N nodes at most, max_depth deep) — a
    chain would undervalue a tree drafter, which might then never draft and never show its real
    shape."""
    n = num_nodes
    idx = np.arange(n)
    if static_parents is not None:
        parents = np.asarray(static_parents, np.int32)
        shaped, ranks, above = np.ones(n, bool), 0, parents
    else:
        ranks = 1 if is_chain else min(n, MAX_RANK_KEYS)
        if is_chain:
            parents, shaped = np.where(idx < max_depth, idx - 1, -1), idx < max_depth
        else:  # node i's children are 2i+2 and 2i+3; depth of node i: floor(log2(i + 2))
            parents = np.where(idx >= 2, (idx - 2) // 2, -1)
            shaped = np.floor(np.log2(idx + 2)) <= max_depth
        parents = parents.astype(np.int32)
        k = np.arange(max_depth * ranks)
        above = np.where(k >= ranks, (k // ranks - 1) * ranks, -1)  # (d, r) -> (d - 1, 0)
    node_depth = depths(jnp.asarray(parents))  # [N]
    levels = jnp.arange(1, max_depth + 1)[:, None]  # [D, 1]
    nodes_to_depth = jnp.sum(jnp.asarray(shaped)[None, :] & (node_depth[None, :] <= levels), axis=1,
                             dtype=jnp.int32)  # [D]
    # each key's depth: d of a (d, r) key, a node key's node depth
    key_depth = jnp.arange(len(above)) // ranks + 1 if ranks else node_depth
    start = jnp.full((len(above),), policy.prior, jnp.float32)
    if policy.prior_by_depth:
        table = jnp.asarray(policy.prior_by_depth, jnp.float32)
        start = table[jnp.minimum(key_depth, len(table)) - 1]
    # Each key's sibling rank: the priors are a first child's; a later one starts at the guess
    # sibling_share, given its earlier siblings missed ("Later siblings").
    key_rank = jnp.arange(len(above)) % ranks if ranks else _siblings(jnp.asarray(parents)[None])[0][0]
    start = jnp.where(key_rank > 0, policy.sibling_share, start)
    if policy.classes:  # one key per class, each drifting toward 1 when untried (as a depth-1 key does)
        above = np.full(policy.classes, -1)
        start = jnp.full((policy.classes,), policy.prior, jnp.float32)
        if policy.prior_by_class:
            table = jnp.asarray(policy.prior_by_class, jnp.float32)
            start = table[jnp.minimum(jnp.arange(policy.classes), len(table) - 1)]
        key_rank = jnp.zeros(policy.classes, jnp.int32)
        key_depth = jnp.full((policy.classes,), max_depth)
    weight = jnp.where(key_rank > 0, _steady_weight(policy), max(float(policy.prior_weight), _steady_weight(policy)))
    guessed = not (policy.prior_by_class if policy.classes else policy.prior_by_depth)  # the start is `prior`
    never_tried = (key_rank == 0) & (policy.first_look and guessed)
    return PolicyState(accept=jnp.broadcast_to(start, (batch, len(above))),
                       weight=jnp.broadcast_to(weight.astype(jnp.float32), (batch, len(above))),
                       above=jnp.asarray(above, jnp.int32),
                       parents=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (batch, n)),
                       shaped=jnp.broadcast_to(jnp.asarray(shaped), (batch, n)),
                       node_classes=jnp.zeros((batch, n), jnp.int32), stale=jnp.zeros((batch,), jnp.int32),
                       wait=jnp.full((batch,), policy.probe_first, jnp.int32),
                       full_parents=jnp.asarray(parents, jnp.int32), full_shaped=jnp.asarray(shaped),
                       key_depth=key_depth.astype(jnp.int32), nodes_to_depth=nodes_to_depth,
                       hold=jnp.int32(0), backoff=jnp.int32(1), streak=jnp.int32(0), payoff=jnp.float32(0.0),
                       explore_scale=jnp.float32(1.0),
                       never_tried=jnp.broadcast_to(never_tried, (batch, len(above))),
                       looking=jnp.zeros((batch,), bool),
                       ranks=ranks, depth=max_depth, classes=policy.classes)


def _down(parents, own, root, combine, steps: int):
    """x_i = combine(own_i, x_parent(i)), x of the root's children's parent = `root`, for every node of
    depth <= steps: `steps` vectorised passes over all nodes (a tree is shallow; N may not be)."""
    p = jnp.maximum(parents, 0)
    top = parents < 0
    x = combine(own, jnp.broadcast_to(root, own.shape))
    for _ in range(steps - 1):
        x = combine(own, jnp.where(top, root, jnp.take_along_axis(x, p, axis=1)))
    return x


def _depths(parents, steps: int):
    """Each node's depth (the root's children: 1), for trees at most `steps` deep: int32[B, N]."""
    return _down(parents, jnp.ones_like(parents), 0, jnp.add, steps)


def _siblings(parents):
    """(sibling rank int32[B, N], earlier bool[B, N, N]: [b, i, j] = j is an earlier sibling of i)."""
    n = parents.shape[1]
    idx = jnp.arange(n)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] < idx[None, :, None])  # [B, i, j]
    return jnp.sum(earlier, axis=2).astype(jnp.int32), earlier


def node_keys(state: PolicyState, parents, rank=None):
    """int32[B, N]: each node's key (see PolicyState.ranks); K (one past the last) for nodes deeper
    than the estimates reach."""
    b, n = parents.shape
    k = state.accept.shape[1]
    if state.classes:  # the node's confidence class (the shape's, as stored with it)
        return jnp.clip(state.node_classes, 0, state.classes - 1).astype(jnp.int32)
    if state.ranks == 0:
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    if rank is None:
        rank = _siblings(parents)[0]
    key = (_depths(parents, state.depth) - 1) * state.ranks + jnp.minimum(rank, state.ranks - 1)
    return jnp.where(key < k, key, k).astype(jnp.int32)


def _node_values(policy: AdaptivePolicy, state: PolicyState, parents, shaped):
    """For each node of a shape: (reach f32[B, N], order int32[B, N], eligible count int32[B], depth
    int32[B, N] with a batch spread, else None).
    order lists the eligible nodes best first by a score: the product along the node's path of the
    nodes' chances given their parents (a_i, module docstring) made non-increasing in sibling rank, so
    a node never scores above its parent nor its previous sibling; ties go to the lower index, so every
    leading part of `order` is closed under parents and earlier siblings. Eligible: a node of the shape
    whose earlier siblings and ancestors (and theirs) are of the shape too, with a score >= min_reach."""
    rank, earlier = _siblings(parents)
    est = jnp.concatenate([state.accept, jnp.zeros_like(state.accept[:, :1])], axis=1)
    est = jnp.take_along_axis(est, node_keys(state, parents, rank), axis=1)  # [B, N]: conditional rates
    # A node is accepted when its parent is, its earlier siblings are not, and then it is (at most one
    # child of a node is accepted): P(i | parent) = c_i * prod over earlier siblings j of (1 - c_j).
    missed = jnp.einsum("bij,bj->bi", earlier.astype(est.dtype), jnp.log(jnp.clip(1.0 - est, 1e-30, 1.0)))
    est = est * jnp.exp(missed)  # [B, N]
    capped = jnp.minimum(est, jnp.min(jnp.where(earlier, est[:, None, :], 1.0), axis=2))  # <= earlier siblings'
    own_ok = shaped & ~jnp.any(earlier & ~shaped[:, None, :], axis=2)
    reach = _down(parents, est, 1.0, jnp.multiply, state.depth)
    score = _down(parents, capped, 1.0, jnp.multiply, state.depth)
    ok = _down(parents, own_ok, True, jnp.logical_and, state.depth) & (score >= policy.min_reach)
    order = jnp.argsort(jnp.where(ok, -score, 1.0), axis=1, stable=True).astype(jnp.int32)  # ties: lower index
    depth = _depths(parents, state.depth) if policy.batch_spread > 0 else None  # read by the spread alone
    return jnp.where(ok, reach, 0.0), order, jnp.sum(ok, axis=1).astype(jnp.int32), depth


def _width_terms(policy, reach, order, eligible, depth, costs, remaining, drafted: bool, alone: bool = False):
    """(nodes each row keeps at each width int32[W, B], steps each row needs at each width f32[W, B]
    (0 for a done row; in a batch, its share of the expected maximum: "Batch spread"), seconds per
    step at each width f32[W], the margin included). remaining: int32[B], the tokens each row still
    has to go (0: done). alone: every row judged as a batch of its own (no spread)."""
    active = remaining > 0
    widths = jnp.asarray(policy.widths, jnp.int32)  # [W]
    if policy.shape == "none":  # all or nothing
        count = jnp.where(widths[:, None] >= widths[-1], eligible[None], 0)
    else:
        count = jnp.minimum(widths[:, None], eligible[None])  # [W, B]
    best_first = jnp.take_along_axis(reach, order, axis=1)  # [B, N]: 0 past the eligible ones
    zero = jnp.zeros_like(best_first[:, :1])
    expected = 1.0 + jnp.concatenate([zero, jnp.cumsum(best_first, axis=1)], axis=1)
    gain = jnp.take_along_axis(expected, count.T, axis=1).T  # [W, B]: E_b at each width
    # Tokens past a row's budget are dropped: a row with r tokens to go gains at most r (its last
    # token needs one step however many nodes it verifies).
    capped = jnp.minimum(gain, jnp.maximum(remaining, 1)[None].astype(jnp.float32))
    left = remaining[None].astype(jnp.float32)
    steps = jnp.where(active[None], left / capped, 0.0)  # [W, B]
    if not alone and policy.batch_spread > 0 and remaining.shape[0] > 1:  # "Batch spread"
        # Var of the accepted count K (the accepted path's depth): the kept set is closed under parents
        # and one node per depth is on the path, so P(K >= d) = sum of the kept depth-d nodes' reach
        # and E[K^2] = sum_d (2d - 1) P(K >= d) = sum over kept nodes of (2 depth - 1) reach.
        odd = 2.0 * jnp.take_along_axis(depth, order, axis=1).astype(jnp.float32) - 1.0  # [B, N] best first
        second = jnp.concatenate([zero, jnp.cumsum(odd * best_first, axis=1)], axis=1)
        var = jnp.maximum(jnp.take_along_axis(second, count.T, axis=1).T - (gain - 1.0) ** 2, 0.0)  # [W, B]
        # Steps to commit r tokens at g +- sqrt(var) a step: r / g, spread sqrt(r var / g^3).
        spread = jnp.where(active[None], jnp.sqrt(left * var / gain ** 3), 0.0)  # [W, B]
        # The maximum is contested by the rows within two spreads of the slowest mean: all of them when
        # the rows are level (a fixed-length batch's start), the last row alone once it lags well behind.
        contenders = jnp.sum(active[None] & (steps + 2.0 * spread >= jnp.max(steps, axis=1, keepdims=True)), axis=1)
        kappa = jnp.asarray(expected_max_normal(remaining.shape[0]))[contenders]  # [W]
        steps = steps + policy.batch_spread * kappa[:, None] * spread
    w = len(policy.widths)
    verify, draft, idle = costs[:w], costs[w:2 * w], costs[2 * w]
    # Before drafting, a width costs its own draft (a capped draft is shorter); after it, what was
    # drafted is spent whatever is kept: the same cost at every width (entry 0, the whole proposal).
    step = verify + jnp.where(drafted, draft[0], jnp.where(widths > 0, draft, idle))
    return count, steps, step * jnp.where(widths > 0, 1.0 + margin_at(policy, remaining.shape[0]), 1.0)


def margin_at(policy: AdaptivePolicy, batch: int) -> float:
    """The margin a drafting width must beat the plain step by in a batch of `batch` rows (static): the
    whole batch's, also where a row is judged alone, since a row's proposal pays only if it makes the
    batch draft."""
    return policy.margin if batch == 1 or policy.batch_margin is None else policy.batch_margin


@functools.cache
def expected_max_normal(n: int) -> np.ndarray:
    """f32[n + 1]: entry k is E[max of k independent standard normals] (0 for k <= 1), by quadrature of
    k x phi(x) Phi(x)^(k-1) (about 1e-5 off; 1.03 for 4, 1.77 for 16, 3.9 for 10^4)."""
    x = np.linspace(-10.0, 10.0, 4001)
    dx = x[1] - x[0]
    phi = np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)
    log_cdf = np.log(np.maximum((np.cumsum(phi) - 0.5 * phi) * dx, 1e-300))  # trapezoid
    out = np.zeros(n + 1, np.float64)
    for lo in range(2, n + 1, 512):  # [chunk, X] at a time: a batch of 10^4 rows needs no 10^4 x X array
        k = np.arange(lo, min(lo + 512, n + 1), dtype=np.float64)[:, None]
        out[lo:lo + len(k)] = np.sum(x * k * phi * np.exp((k - 1) * log_cdf), axis=1) * dx
    return out.astype(np.float32)


def _best_width(policy, reach, order, eligible, depth, costs, remaining, drafted: bool):
    """(index of the best width for the batch, nodes each row keeps at each width int32[W, B]): the
    width that finishes the batch soonest (its slowest row's steps, seconds per step)."""
    count, steps, step = _width_terms(policy, reach, order, eligible, depth, costs, remaining, drafted)
    return jnp.argmin(step * jnp.max(steps, axis=1)), count


def _plain_seconds(policy: AdaptivePolicy, costs):
    """f32[]: what a step that drafts nothing costs: a plain step and the drafter's idle (cost_vector)."""
    return costs[0] + costs[2 * len(policy.widths)]


def probe_period(policy: AdaptivePolicy, costs):
    """int32[]: the longest wait between shape probes: at least `probe_every`, and enough that a probe
    that keeps nothing costs at most `probe_cost` of the plain steps between probes. Such a probe costs
    its draft (a lookup drafter on a GPU: ~0.4 of a plain step, a probe every ~20 steps there) and an
    engine step in place of a lean plain one, priced as the narrowest drafting width's extra (on the
    CPU at batch 16, sampling: 0.27 of a plain step, where the draft costs ~0.001)."""
    w = len(policy.widths)
    plain = _plain_seconds(policy, costs)
    failed = costs[w] + jnp.maximum(costs[1] - costs[0], 0.0)
    need = jnp.ceil(failed / (policy.probe_cost * jnp.maximum(plain, 1e-9)))
    return jnp.maximum(need, policy.probe_every).astype(jnp.int32)


def _with_probe(policy: AdaptivePolicy, state: PolicyState, costs, remaining) -> PolicyState:
    """The state whose shape the plan judges: rows due a probe (see AdaptivePolicy.probe_every) take
    the drafter's full shape in place of their last proposal's, and a first look where one is due."""
    if policy.shape != "proposal":  # the shape is the fixed structure, or all or nothing: nothing to probe
        return state
    due = (state.stale >= state.wait)[:, None]
    state = dataclasses.replace(state, parents=jnp.where(due, state.full_parents[None], state.parents),
                                shaped=jnp.where(due, state.full_shaped[None], state.shaped))
    return _looking(policy, state, costs, remaining, due[:, 0])[0]


def _looking(policy: AdaptivePolicy, state: PolicyState, costs, remaining, due):
    """(the state as a shape probe judges it, bool[B]: the rows that take a first look). due: bool[B],
    rows due a probe: their never-tried keys are judged as if always accepted, to the depth the row can
    afford, and the keys below it as never accepted (see "First looks")."""
    w = len(policy.widths)
    # A look that finds nothing costs its draft and a step at its width in place of a plain one.
    spent = costs[w] + jnp.maximum(costs[:w] - costs[0], 0.0)  # [W]
    budget = policy.probe_cost * _plain_seconds(policy, costs) * remaining  # [B]
    width_at = jnp.minimum(jnp.searchsorted(jnp.asarray(policy.widths), state.nodes_to_depth), w - 1)
    cost_at = spent[width_at]  # [D]: a look to depth d at the width holding it (costs rise with width)
    depth = jnp.sum(cost_at[None, :] <= budget[:, None], axis=1)  # [B]: the deepest affordable look
    within = state.key_depth[None, :] <= depth[:, None]  # [B, K]
    wants = due & jnp.any(state.never_tried & within, axis=1)
    # A batch drafts when its slowest row pays: the rows that have never-tried keys look together or not
    # at all (a lone row's look is outvoted by the others' plain plans).
    together = jnp.all(wants | (remaining <= 0) | ~jnp.any(state.never_tried, axis=1))
    look = wants & together
    judged = jnp.where(within, jnp.where(state.never_tried, 1.0, state.accept), 0.0)
    return dataclasses.replace(state, accept=jnp.where(look[:, None], judged, state.accept)), look


def draft_plan(policy: AdaptivePolicy, state: PolicyState, costs, remaining):
    """(bool[]: does drafting pay this step, int32[B]: the nodes each row would verify at the best
    width), judged before drafting on the previous proposal's shape (the full shape for rows due a
    probe); the second is what a `level_capped` drafter is told to draft at most
    (DraftContext.max_nodes). remaining: int32[B], tokens each row still has to go (0: done)."""
    held = state.hold > 0
    state = _with_probe(policy, state, costs, remaining)
    state = _as_next(state)
    values = _node_values(policy, state, state.parents, state.shaped)
    best, count = _best_width(policy, *values, costs, remaining, drafted=False)
    return (best > 0) & ~held, count[best]


def _as_next(state: PolicyState) -> PolicyState:
    """The state as the plan judges the next proposal: a class-keyed one's classes are unknown before
    drafting, so every node is judged as of the best class (drafting is a lookup; a row whose last
    proposal did not pay at its own classes has no shape to judge, `_schedule_probes`)."""
    if not state.classes:
        return state
    return dataclasses.replace(state, node_classes=jnp.full_like(state.node_classes, state.classes - 1))


def _rows_that_pay(policy: AdaptivePolicy, state: PolicyState, costs, remaining, as_drafted: bool = False):
    """bool[B]: would the plan draft for this row alone, on its recorded shape (as_drafted: at the
    classes it was drafted with, not at the best class the plan assumes of the next proposal)?"""
    values = _node_values(policy, state if as_drafted else _as_next(state), state.parents, state.shaped)
    # Each row as a batch of its own (`_best_width` with the other rows done), for all rows at once:
    # O(B) (a vmap over the batch of whole-batch plans was O(B^2): truncate took 39.7 ms at batch 1024 on
    # the CPU, 3.5 ms now).
    _, steps, step = _width_terms(policy, *values, costs, remaining, drafted=False, alone=True)
    return jnp.argmin(step[:, None] * steps, axis=0) > 0


def should_draft(policy: AdaptivePolicy, state: PolicyState, costs, remaining):
    """bool[]: does drafting pay this step (judged on the previous proposal's shape)? remaining:
    int32[B], tokens each row still has to go (0: done)."""
    return draft_plan(policy, state, costs, remaining)[0]


def plain_run_length(policy: AdaptivePolicy, state: PolicyState, costs, remaining, cap, *,
                     max_run: int | None = None, vectorized: bool | None = None):
    """int32[]: how many plain steps to take in a row from here, when this step does not draft (cap: an
    int, or int32[] <= max_run, a static bound (default: cap when it is an int, else policy.plain_run);
    0: none): the first k in 1..cap at which `should_draft` would say yes on the estimates drifted k
    steps (and each row's remaining tokens shrunk by k), else cap. So a run ends exactly where the
    step-by-step engine would draft (or probe) again. Every k is checked: a coarser grid (1, 2, 4, ...)
    rounded down cut a run due in 8 steps into runs of 4, 2, 1 and 1, and each run's end costs a whole
    engine step (on the CPU, sampling with prompt lookup, 67 such steps for 128 tokens and 12% slower
    than plain decoding).

    Two forms, the same answer. On the CPU (`vectorized` False, the default there) the k are tried one
    after another and the search stops at the first flip: a vmap over all k at once is faster alone
    (0.07 vs 0.10 ms for 32 at batch 1) but cost ~10 ms per run inside the engine's loop there, 0.3 ms per
    plain token at batch 1 (benchmarks: "The plain run's length"). On a GPU or TPU (True) it is that
    vmap: each trip of the loop is a round of small kernel launches and a read of the loop's condition
    by the host, about one trip per plain token, where the engine's plain step cost 1.4 plain decoding
    steps on an H200 (BENCHMARKS.md, "On a GPU a third time")."""
    active = remaining > 0

    def drafts_after(k):
        st = drift(policy, state, jnp.where(active, k, 0))
        return should_draft(policy, st, costs, jnp.maximum(remaining - k, 0))

    if vectorized is None:
        vectorized = jax.default_backend() != "cpu"
    if vectorized:
        if max_run is None:
            max_run = cap if isinstance(cap, (int, np.integer)) else policy.plain_run
        if isinstance(cap, (int, np.integer)) and cap > max_run:
            raise ValueError(f"plain_run_length: cap {cap} exceeds max_run {max_run}, the longest run it tries")
        ks = jnp.arange(1, max_run + 1, dtype=jnp.int32)  # [max_run]
        flips = jax.vmap(drafts_after)(ks) & (ks <= cap)
        return jnp.where(jnp.any(flips), jnp.argmax(flips).astype(jnp.int32) + 1,
                         jnp.asarray(cap, jnp.int32))

    def searching(carry):
        k, flipped = carry
        return (k < cap) & ~flipped

    def try_next(carry):  # would the step after k + 1 plain ones draft?
        k = carry[0] + 1
        return k, drafts_after(k)

    k, _ = jax.lax.while_loop(searching, try_next, (jnp.int32(0), jnp.bool_(False)))
    return k


def _schedule_probes(policy: AdaptivePolicy, state: PolicyState, new: PolicyState, costs, remaining, empty):
    """The state after a drafting step (shape "proposal"), its waits for a shape probe updated. `new`
    holds this proposal's shape (an empty row's last one); empty: bool[B], rows that proposed nothing.

    A row *missed* when its proposal was empty (no match) or, keyed by confidence class, did not pay at
    its own classes (a weak match: the plan, which judges a recorded shape at the best class, would draft
    it again next step, and the step would keep nothing). A miss at a probe was a probe all the same:
    the row waits again, twice as long. A miss from a row drafting on a shape that pays stops the row: it
    probes after one step, then 2, 4, ... while probes miss, its shape cleared until one pays. So no row
    runs an engine step per token while its proposals keep nothing (prompt lookup sampling on the CPU:
    12% slower than plain decoding; the retrieval default at T = 0.7 drafted on 58 of 60 steps and kept
    nothing on 37). A proposal that does not pay from a position-keyed drafter is recorded (the plan
    judges it as it is) and waits `probe_first` at least, doubling likewise."""
    pays = _rows_that_pay(policy, new, costs, remaining, as_drafted=True)  # this proposal, alone
    missed, was_paying = empty, pays  # (an empty row still holds its last shape in `new`)
    if state.classes:
        missed = empty | ~pays
        was_paying = _rows_that_pay(policy, state, costs, remaining)  # what the plan judged before drafting
    longer = jnp.minimum(2 * state.wait, probe_period(policy, costs))
    due = state.stale >= state.wait
    wait = jnp.where(missed, jnp.where(due, longer, jnp.where(was_paying, 1, state.wait)),
                     jnp.where(pays, policy.probe_first, jnp.maximum(longer, policy.probe_first)))
    stale = jnp.where(missed, jnp.where(due | was_paying, 0, state.stale), new.stale)
    cleared = missed & (~empty | (~due & was_paying))
    return dataclasses.replace(new, wait=wait, stale=stale, shaped=jnp.where(cleared[:, None], False, new.shaped))


def truncate(policy: AdaptivePolicy, state: PolicyState, costs, tree: Tree, remaining, shape_valid=None):
    """Keep each row's best nodes for the chosen width: (tree with only they valid, nodes kept int32[B],
    state with this proposal's shape). remaining: as in `should_draft`. shape_valid: bool[B, N], the
    nodes the proposal would have had uncapped, when the drafter drafted only DraftContext.max_nodes
    levels (the shape recorded for the next step's plan; only drafted nodes are kept): without it a
    draft capped at one node would record a one-node shape, and the plan could never grow again."""
    active = remaining > 0
    valid = tree.valid
    shape_nodes = valid if shape_valid is None else shape_valid
    # A row whose proposal is empty this step (e.g. no n-gram match) says nothing about the shape of
    # its next one: keep its last shape (shape "proposal": until its next probe, below).
    has = jnp.any(shape_nodes, axis=1)[:, None]
    shaped = shape_nodes if policy.shape == "proposal" else jnp.ones_like(valid)  # "structure": parents only
    new = dataclasses.replace(state, parents=jnp.where(has, tree.parents, state.parents),
                              shaped=jnp.where(has, shaped, state.shaped), stale=jnp.where(has[:, 0], 0, state.stale))
    if state.classes:
        if tree.classes is None:
            raise ValueError("an adaptive policy keyed by confidence class needs proposals with Tree.classes "
                             "(the drafter's confidence_classes); this drafter's trees have none")
        new = dataclasses.replace(new, node_classes=jnp.where(has, tree.classes.astype(jnp.int32),
                                                              state.node_classes))
    # What this step keeps is judged on: "proposal", this proposal (an empty row has nothing to gain, not
    # its last shape's worth); "structure", the fixed structure (validity may follow sampled tokens);
    # "none", the previous proposal (the shape follows this step's sampled tokens).
    if policy.shape == "proposal":
        judged, looking = _looking(policy, dataclasses.replace(new, shaped=new.shaped & has), costs, remaining,
                                   state.stale >= state.wait)
        new = _schedule_probes(policy, state, new, costs, remaining, ~has[:, 0])
        new = dataclasses.replace(new, looking=looking)
    else:
        judged = new if policy.shape == "structure" else state
    reach, order, eligible, depth = _node_values(policy, judged, judged.parents, judged.shaped)
    best, count = _best_width(policy, reach, order, eligible, depth, costs, remaining, drafted=True)
    if policy.shape == "none":
        keep = jnp.broadcast_to(best == len(policy.widths) - 1, valid.shape)
    else:
        pos = jnp.argsort(order, axis=1)  # each node's place in the best-first order
        keep = pos < count[best][:, None]
    keep = keep & valid & active[:, None]
    new = _back_off(policy, new, costs, jnp.any(keep))
    return tree.replace(valid=keep), jnp.sum(keep, axis=1).astype(jnp.int32), new


def _back_off(policy: AdaptivePolicy, state: PolicyState, costs, kept_any) -> PolicyState:
    """The batch's hold after a drafting step (see "Batch backoff"): none once it keeps a node; else the
    backoff, which doubles up to `probe_period`."""
    longer = jnp.minimum(2 * state.backoff, probe_period(policy, costs))
    return dataclasses.replace(state, hold=jnp.where(kept_any, 0, state.backoff).astype(jnp.int32),
                               backoff=jnp.where(kept_any, 1, longer).astype(jnp.int32))


def compact(tree: Tree, draft_probs=None):
    """Gather each row's valid nodes into its first slots, in their order (topological: parents stay
    before children), so a forward over the first w slots holds them: (tree, draft_probs per parent
    slot [B, N+1, V] or None, perm int32[B, N]: slot j holds node perm[j]). Invalid nodes follow as
    children of the root."""
    perm = jnp.argsort(~tree.valid, axis=1, stable=True).astype(jnp.int32)
    inv = jnp.argsort(perm, axis=1).astype(jnp.int32)
    par = jnp.take_along_axis(tree.parents, perm, axis=1)
    valid = jnp.take_along_axis(tree.valid, perm, axis=1)
    parents = jnp.where(valid & (par >= 0), jnp.take_along_axis(inv, jnp.maximum(par, 0), axis=1), -1)
    out = Tree(tokens=jnp.take_along_axis(tree.tokens, perm, axis=1), parents=parents.astype(jnp.int32),
               valid=valid)
    if draft_probs is not None:
        slots = jnp.concatenate([jnp.zeros_like(perm[:, :1]), perm + 1], axis=1)  # [B, N+1]
        draft_probs = jnp.take_along_axis(draft_probs, slots[:, :, None], axis=1)
    return out, draft_probs, perm


def expand(perm, path, logits=None, features=None):
    """Undo `compact` on a verdict: (path with the drafter's node indices, logits, features). path
    int32[B, N] (-1 padded) holds compact slots' nodes; logits [B, N+1, V] and features [F, B, N+1, D]
    (None passes) are over compact parent slots. The slots of nodes that were not kept get some slot's
    values: those nodes were invalid, and nothing reads them."""
    path = jnp.where(path >= 0, jnp.take_along_axis(perm, jnp.maximum(path, 0), axis=1), -1)
    inv = jnp.argsort(perm, axis=1).astype(jnp.int32)
    slots = jnp.concatenate([jnp.zeros_like(inv[:, :1]), inv + 1], axis=1)  # [B, N+1]: compact slot of each
    if logits is not None:
        logits = jnp.take_along_axis(logits, slots[:, :, None], axis=1)
    if features is not None:
        features = jnp.take_along_axis(features, slots[None, :, :, None], axis=2)
    return path, logits, features


def update(policy: AdaptivePolicy, state: PolicyState, tree: Tree, path, committed, num_accepted, active,
           costs=None, lag=None):
    """Fold one verification into the estimates. tree: the verified proposal (valid = the kept nodes);
    path int32[B, N] / num_accepted int32[B]: the verifier's accepted nodes, committed int32[B] how
    many of them were committed (fewer when EOS or max_new_tokens cut the row; the verdict past the
    cut is discarded). costs: the cost vector, which scores a return to drafting ("Returns to
    drafting"; None: not scored); lag: int32[], the tokens beyond a steady step's that the drafter
    caught up on before this proposal (the most of any live row; None: it keeps up)."""
    b, n = tree.parents.shape
    rows = jnp.arange(b)[:, None]
    d = _depths(tree.parents, state.depth)
    on_path = jnp.zeros((b, n + 1), bool).at[rows, jnp.where(path >= 0, path, n)].set(
        jnp.arange(n)[None, :] < committed[:, None])[:, :n]
    parent_in = (tree.parents < 0) | jnp.take_along_axis(on_path, jnp.maximum(tree.parents, 0), axis=1)
    uncut = (committed == num_accepted)[:, None]
    # Tried: kept, its parent committed and none of its earlier siblings (the estimates are conditional
    # on the earlier ones missing; a kept set holds a node's earlier siblings).
    _, earlier = _siblings(tree.parents)
    sibling_in = jnp.any(earlier & on_path[:, None, :], axis=2)  # [B, N]
    tried = tree.valid & parent_in & ~sibling_in & ((d <= committed[:, None]) | uncut) & active[:, None]
    k = state.accept.shape[1]
    keys = node_keys(state, tree.parents)
    tried_k = jnp.zeros((b, k + 1), bool).at[rows, keys].max(tried)[:, :k]
    accepted_k = jnp.zeros((b, k + 1), bool).at[rows, keys].max(tried & on_path)[:, :k]
    a, n, x = state.accept, state.weight, accepted_k.astype(jnp.float32)
    # A running estimate (weight 1 - decay per observation) once its weight is at the steady state; a
    # heavier prior takes observations at 1 / (decay * n + 1) while its weight decays toward it.
    heavy = n > _steady_weight(policy)
    w = 1.0 / (policy.decay * n + 1.0)
    seen = jnp.where(heavy, (1.0 - w) * a + w * x, policy.decay * a + (1.0 - policy.decay) * x)
    # A first look's verdict on a key weighs against the flat guess as one observation against another.
    # In a batch a miss leaves the guess and a row looks once ("First looks": one row's unlucky miss
    # would hold the whole batch plain).
    first = state.looking[:, None] & state.never_tried & tried_k
    verdict = x if b == 1 else jnp.maximum(x, a)
    seen = jnp.where(first, a + (verdict - a) / (policy.decay + 1.0), seen)
    never_tried = state.never_tried & ~tried_k
    if b > 1:  # even a row whose proposal was empty at the look: looks for it alone would cost the batch
        never_tried = never_tried & ~state.looking[:, None]
    new = jnp.where(tried_k, seen, _drifted(state, policy.explore * state.explore_scale))
    n_new = jnp.where(tried_k & heavy, jnp.maximum(policy.decay * n + 1.0, _steady_weight(policy)), n)
    if costs is not None:
        state = _score_return(policy, state, tree, committed, active, costs, lag)
    drafted = jnp.any(tree.valid & active[:, None])
    state = dataclasses.replace(state, streak=jnp.where(drafted, state.streak + 1, 0).astype(jnp.int32))
    return dataclasses.replace(state, accept=jnp.where(active[:, None], new, a),
                               weight=jnp.where(active[:, None], n_new, n), never_tried=never_tried,
                               looking=jnp.zeros_like(state.looking),
                               stale=state.stale + active.astype(jnp.int32), hold=jnp.maximum(state.hold - 1, 0))


def _score_return(policy: AdaptivePolicy, state: PolicyState, tree: Tree, committed, active, costs, lag):
    """The state with a return to drafting scored, when this step is one (it kept a node after a plain
    step): `payoff` takes the plain steps it saved, and `explore_scale` halves while the running payoff
    is below 0, else doubles (see "Returns to drafting")."""
    w = len(policy.widths)
    kept = jnp.sum(tree.valid & active[:, None], axis=1)
    returned = (jnp.max(kept) > 0) & (state.streak == 0)
    at = jnp.searchsorted(jnp.asarray(policy.widths), jnp.max(kept))  # the forward's width
    plain = _plain_seconds(policy, costs)
    caught_up = 0.0 if lag is None or costs.shape[0] <= 2 * w + 1 else costs[2 * w + 1] * jnp.maximum(lag, 0)
    spent = costs[at] + costs[w + at] + caught_up
    live = jnp.maximum(jnp.sum(active), 1)
    tokens = jnp.sum(jnp.where(active, committed + 1, 0)) / live  # committed nodes and the bonus, per live row
    saved = (tokens * plain - spent) / plain
    payoff = jnp.where(returned, policy.decay * state.payoff + (1.0 - policy.decay) * saved, state.payoff)
    scale = jnp.where(payoff < 0.0, jnp.maximum(state.explore_scale / 2, policy.explore_floor),
                      jnp.minimum(state.explore_scale * 2, 1.0))
    return dataclasses.replace(state, payoff=payoff.astype(jnp.float32),
                               explore_scale=jnp.where(returned, scale, state.explore_scale).astype(jnp.float32))


def _steady_weight(policy: AdaptivePolicy) -> float:
    """The observations a running estimate with this decay counts as: 1 / (1 - decay)."""
    return 1.0 / max(1.0 - policy.decay, 1e-6)


def _drifted(state: PolicyState, rate):
    """Every estimate moved by `rate` (a scalar, or f32[B, 1] per row) toward where an untried key
    drifts: depth 1 toward 1 (optimism: a row that stopped drafting probes again once its estimate
    crosses what pays; the cheaper the draft, the sooner, and the cheaper the probe), a deeper one
    toward the key above (a drafter that is always right grows its tree)."""
    a = state.accept
    above = jnp.where(state.above[None] >= 0, a[:, jnp.maximum(state.above, 0)], 1.0)
    return a + rate * (above - a)


def drift(policy: AdaptivePolicy, state: PolicyState, steps):
    """The estimates after `steps` int32[B] plain steps per row (no key tried): `update`'s drift
    compounded, rate 1 - (1 - explore)^steps toward where each key drifts — exact for depth-1 keys;
    a deeper key drifts toward its key above as that stood before the steps (a little slower than
    step by step)."""
    rate = 1.0 - (1.0 - policy.explore * state.explore_scale) ** steps.astype(jnp.float32)[:, None]
    state = dataclasses.replace(state, streak=jnp.where(jnp.any(steps > 0), 0, state.streak).astype(jnp.int32))
    # A look whose step kept nothing (the lean run follows it, not `update`) is over.
    return dataclasses.replace(state, accept=_drifted(state, rate), stale=state.stale + steps.astype(jnp.int32),
                               hold=jnp.maximum(state.hold - jnp.max(steps), 0).astype(jnp.int32),
                               looking=jnp.zeros_like(state.looking))
