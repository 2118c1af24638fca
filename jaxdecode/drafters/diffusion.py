"""A masked-diffusion LM (LLaDA, Dream, Fast-dLLM v2, `jaxdecode train dllm`) as a parallel drafter: a
chain of k tokens per step from ONE forward of the dLLM.

Input per row: the last `window` committed tokens (the pending one last), then k MASK slots (or
`slots` >= k; a block-diffusion model gets whole blocks of MASK, as it was trained on):

    [h_{t-W+1} .. h_t ; MASK x k]      positions 0 .. W+k-1 from the window's first token

attended bidirectionally (attention="bidirectional"), or block-causally with the blocks aligned to start
at the first MASK slot (attention="block": the window lies in earlier blocks, as a block-diffusion
model sees a finished prefix). Slot i's logits give q_i, the dLLM's marginal of token t+1+i (with
logits_shift=1, Dream style, they are read one column earlier: the pending token's column predicts
slot 0). Positions count from the window's first token: a RoPE model's attention depends only on
position differences, so the window is seen as at its absolute place, and positions stay below
W + k whatever the history length (a short history is left-padded with invisible columns).

Drafting: node i of the chain is argmax q_i (greedy: child rule "argmax") or a draw from q_i at the
sampler's temperature (child rule "sample"), and q_i is the draft distribution handed to the verifier
at node i's parent slot. Why the chain verifiers (chain, specinfer, block, ...) stay lossless although
x_i is drawn from q_i *independently of* the draft tokens before it: their proof needs only that, given
the context and x_{<i}, node i is a draw from the distribution handed for it. A dLLM's q_i is a
function of the context alone, so q_i(. | x_{<i}) = q_i is exactly that distribution; the chain
simply ignores its own earlier tokens (which lowers acceptance, never exactness).

Refinement (`steps` > 1): the k slots are drafted in `steps` chunks, left to right; forward f sees the
tokens of chunks < f in their slots (MASK after them) and gives the q of chunk f. Left to right keeps
the property above (a slot depends only on earlier slots); committing by confidence in any order
would make an earlier slot depend on a later one and break sampling losslessness.

Vocabulary: the dLLM's must be the target's (one tokenizer); it may add its MASK token after the
target's ids (vocab_size = target's + 1, what `jaxdecode train dllm` does to a tokenizer without one).
Draft distributions cover the target's ids only, and never the MASK id.

The drafter keeps no state (init returns a dummy; observe returns it): a bidirectional dLLM's keys and
values of the window change with every new token, so each step recomputes the window (no KV cache).
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from jaxdecode.drafters.builders import ChainBuilder, build_tree
from jaxdecode.drafters.draft_lm import draft_logprobs
from jaxdecode.models import ModelConfig, bidirectional_mask, block_causal_mask, forward
from jaxdecode.sampling import SamplerConfig

DEFAULT_WINDOW = 128
_NEG = -1e30  # logit of ids the draft never proposes (MASK); finite, so a softmax never sees all -inf


class DiffusionDrafterError(ValueError):
    """A dLLM, tree or option that the dLLM drafter cannot draft with."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DiffusionDrafter:
    """Drafts a chain of k = builder.depth tokens per step from `steps` dLLM forwards (default one).
    Build it with `make_dllm_drafter` (or make_drafter('dllm', ...)), which checks the pieces."""
    params: object  # the dLLM's params
    # `dllm_config`, not `config`: the engine compares a drafter's `config` vocabulary with the target's
    # for equality, and a dLLM may carry one extra id (its MASK); this drafter checks it itself.
    dllm_config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    builder: ChainBuilder = dataclasses.field(metadata=dict(static=True))
    vocab_size: int = dataclasses.field(metadata=dict(static=True))  # the target's: drafts cover ids < it
    mask_id: int = dataclasses.field(metadata=dict(static=True))
    logits_shift: int = dataclasses.field(default=0, metadata=dict(static=True))
    window: int = dataclasses.field(default=DEFAULT_WINDOW, metadata=dict(static=True))
    steps: int = dataclasses.field(default=1, metadata=dict(static=True))
    slots: int = dataclasses.field(default=0, metadata=dict(static=True))  # MASK slots per forward (>= k); 0 = k

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = True
    history_only = True  # observe is the identity: see speculative.Drafter

    @property
    def mask_slots(self) -> int:
        """MASK columns of a forward: `slots`, or k (the chain depth) when 0."""
        return self.slots or self.builder.depth

    @property
    def chunk_starts(self) -> tuple:
        """Slots where a refinement forward starts (the first chunk, slot 0, excluded)."""
        k = self.builder.depth
        size = -(-k // self.steps)
        return tuple(range(size, k, size))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return jnp.zeros((), jnp.int32)

    def slot_logits(self, history, hist_len, drafted, fixed: int):
        """The dLLM's logits of the k slots after each row's pending token: f32[B, k, V_target].

        history int32[B, H], hist_len int32[B] (DraftContext); drafted int32[B, k]: slots < `fixed`
        (static) hold these tokens, the others MASK (as do the mask_slots - k columns after them)."""
        k, m, w = self.builder.depth, self.mask_slots, self.window
        b = history.shape[0]
        idx = hist_len[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, W] history columns
        valid_ctx = idx >= 0
        ctx_tok = jnp.take_along_axis(history, jnp.clip(idx, 0, history.shape[1] - 1), axis=1)
        slot_tok = jnp.where(jnp.arange(m)[None, :] < fixed, jnp.pad(drafted, ((0, 0), (0, m - k))), self.mask_id)
        tokens = jnp.concatenate([jnp.where(valid_ctx, ctx_tok, 0), slot_tok], axis=1)  # [B, W+m]
        valid = jnp.concatenate([valid_ctx, jnp.ones((b, m), bool)], axis=1)
        # Window-relative positions: the first valid column is position 0.
        first = jnp.maximum(w - hist_len, 0)[:, None]
        positions = jnp.maximum(jnp.arange(w + m, dtype=jnp.int32)[None, :] - first, 0)
        cfg = self.dllm_config
        if cfg.attention == "block":  # blocks aligned so the first MASK slot (column W) starts one
            mask = block_causal_mask(valid, cfg.block_size, offset=-w)
        else:
            mask = bidirectional_mask(valid)
        logits, _, _ = forward(cfg, self.params, tokens, positions, None, mask)
        logits = logits[:, w - self.logits_shift:w - self.logits_shift + k, :self.vocab_size]  # [B, k, V]
        if self.mask_id < self.vocab_size:
            logits = logits.at[..., self.mask_id].set(_NEG)
        return logits.astype(jnp.float32)

    def propose(self, state, ctx, sampler: SamplerConfig):
        b, k = ctx.hist_len.shape[0], self.builder.depth
        starts = self.chunk_starts
        drafted = jnp.zeros((b, k), jnp.int32)
        logq = draft_logprobs(self.slot_logits(ctx.history, ctx.hist_len, drafted, 0), sampler)  # [B, k, V]

        def expand(scorer, d, tok, parents):  # the chain's node d is `tok`: q of node d + 1
            logq, drafted = scorer
            drafted = drafted.at[:, d].set(tok[:, 0])  # d: a Python int (ChainBuilder unrolls)
            if d + 1 in starts:  # a refinement forward: the slots so far fixed, the rest MASK
                logq = draft_logprobs(self.slot_logits(ctx.history, ctx.hist_len, drafted, d + 1), sampler)
            return logq[:, d + 1][:, None], (logq, drafted)

        tree, slots, _ = build_tree(self.builder, ctx, (logq, drafted), logq[:, 0], expand, ctx.key)
        return tree, slots, state

    def observe(self, state, obs):
        return state


def _int(name, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
            high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise DiffusionDrafterError(f"dllm drafter: {name} must be an int {span}, got {value!r}")
    return int(value)


def check_tokenizers(target, draft) -> None:
    """When both models carry a tokenizer, every target token must have the same id in the dLLM's."""
    tt, dt = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if tt is None or dt is None or not hasattr(tt, "get_vocab") or not hasattr(dt, "get_vocab"):
        return
    dv = dt.get_vocab()
    bad = [(tok, i, dv.get(tok)) for tok, i in tt.get_vocab().items() if dv.get(tok) != i]
    if bad:
        shown = ", ".join(f"{tok!r}: {i} vs {j}" for tok, i, j in bad[:3])
        raise DiffusionDrafterError(
            f"the dLLM's tokenizer differs from the target's ({len(bad)} tokens have other ids or are "
            f"missing, e.g. {shown}): drafter and target must share one tokenizer")


def make_dllm_drafter(target, draft, tree=None, temperature: float = 0.0, *, window: int = DEFAULT_WINDOW,
                      steps: int = 1, slots=None, mask_id=None, logits_shift=None) -> DiffusionDrafter:
    """The dLLM drafter for `target` (a jaxdecode Model) with the diffusion LM `draft` (a Model).

    tree: 'chain:K' (default chain:4; sampled children at temperature > 0) or a ChainBuilder.
    window: committed tokens the dLLM sees per step; steps: forwards per draft (1..K, left-to-right
    chunks); slots: MASK columns per forward (>= K; default K, or whole blocks of a block-diffusion
    model, which was trained on full blocks). mask_id / logits_shift: override the dLLM config's."""
    from jaxdecode.drafters import tree_from_option

    if draft is None:
        raise DiffusionDrafterError("drafter 'dllm' needs a masked-diffusion LM: pass draft=jaxdecode.load(DIR) "
                                    "(CLI: --draft DIR)")
    dcfg, tcfg = draft.config, target.config
    if not getattr(dcfg, "is_diffusion", False):
        raise DiffusionDrafterError(
            "the draft model is a causal LM (config attention='causal'): drafter 'dllm' drafts with a "
            "masked-diffusion LM (LLaDA, Dream, Fast-dLLM v2, `jaxdecode train dllm`); use drafter='draft_lm' "
            "for a causal draft model")
    mask_id = dcfg.mask_token_id if mask_id is None else mask_id
    if mask_id is None:
        raise DiffusionDrafterError("the dLLM's config has no mask_token_id: pass mask_id=<its MASK id> "
                                    "(drafter_options={'mask_id': ...})")
    mask_id = _int("mask_id", mask_id, 0, dcfg.vocab_size - 1)
    shift = _int("logits_shift", dcfg.logits_shift if logits_shift is None else logits_shift, 0, 1)
    vt, vd = tcfg.vocab_size, dcfg.vocab_size
    if not (vd == vt or (vd > vt and mask_id >= vt)):
        raise DiffusionDrafterError(
            f"the dLLM's vocabulary ({vd} tokens, MASK id {mask_id}) is not the target's ({vt} tokens): "
            f"drafter and target must share one tokenizer (the dLLM may only add ids after the target's, "
            f"its MASK among them)")
    check_tokenizers(target, draft)
    builder = tree_from_option(tree, "chain:4", temperature)
    if not isinstance(builder, ChainBuilder):
        raise DiffusionDrafterError(
            f"drafter 'dllm' drafts a chain (one token per MASK slot, every slot from the same forward): "
            f"use tree='chain:K', got {tree!r}")
    window = _int("window", window, 1)
    steps = _int("steps", steps, 1, builder.depth)
    k = builder.depth
    if slots is None:  # a block model sees whole MASK blocks, as in its training
        slots = -(-k // dcfg.block_size) * dcfg.block_size if dcfg.attention == "block" else k
    slots = _int("slots", slots, k)
    if window + slots > dcfg.max_position_embeddings:
        raise DiffusionDrafterError(
            f"window ({window}) + MASK slots ({slots}) exceeds the dLLM's max_position_embeddings "
            f"({dcfg.max_position_embeddings}): use a smaller window")
    return DiffusionDrafter(params=draft.params, dllm_config=dcfg, builder=builder, vocab_size=vt,
                            mask_id=mask_id, logits_shift=shift, window=window, steps=steps,
                            slots=0 if slots == k else slots)


__all__ = ["DiffusionDrafter", "DiffusionDrafterError", "make_dllm_drafter", "check_tokenizers",
           "DEFAULT_WINDOW"]
