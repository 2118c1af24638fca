"""Masked-diffusion LMs (dLLMs): objectives, training through the shared trainer, export.

    module = DiffusionLM(config, params, attention="bidirectional")      # the LM module, another mask
    loss = DLLMLoss(mask_id=config.mask_token_id)                          # trainer loss_fn
    result = train(module, loss, TaskBatches(task, 64), train_config, workdir)

The network is the pure `jaxdecode.models.forward` held by `training.lm.CausalLM`; `DiffusionLM`
only runs it under a bidirectional mask ("bidirectional", LLaDA / Dream) or, for block diffusion
("block", BD3-LM / Fast-dLLM v2), under the block form's training mask (below).

Objective (LLaDA): per row draw t ~ U(eps, 1), replace each maskable token by MASK with probability t,
and score CE on the masked tokens weighted 1/t; a row's loss is that sum over its maskable count, the
batch loss the mean over rows. `maskable` says which tokens take part: every real token for
pre-training, the answer only for SFT (the prompt is never masked, and never scored).

`logits_shift=1` (Dream; Fast-dLLM v2): the logit at position i predicts token i+1, as in the causal
LM the model was adapted from, so a masked token j is scored with the logits of position j-1 (a token
at position 0 is never masked).

Block diffusion trains all blocks at once (BD3-LM's vectorised form): the forward runs over
[noisy x_t ; clean x_0] (2T tokens, positions repeated). Noisy block b sees its own noisy block and
the clean blocks before it; clean block b sees the clean blocks up to b (block-causal), the same
context a decoder has from the exact KV cache of finished blocks. Each block draws its own t. Blocks
are counted from the row's first maskable token (the answer's start, as jaxdecode.diffusion aligns
them; position 0 in pre-training). With logits_shift=1 the first token of a block is scored
with the clean logits of the token before it (the cached prefix at decode time).

Continued training of a causal LM into a dLLM: `init_from` a causal model (Dream-style:
attention="bidirectional", logits_shift=1; Fast-dLLM v2 style: attention="block", block_size=...,
logits_shift=1). A tokenizer without a MASK token gets one (`add_mask_token`): a new special token
<|mask|> at id = the old vocabulary size, with one new embedding row (and LM-head column) initialised
to the mean of the existing ones.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdecode.dllm_tasks import Task, TaskVocab
from jaxdecode.models import ModelConfig, forward

from .lm import CausalLM, export_lm, model_config
from .trainer import TrainConfig, TrainConfigError, train

ATTENTIONS = ("bidirectional", "block")
MASK_TOKEN = "<|mask|>"
DIFFUSION_FIELDS = ("mask_token_id", "attention", "block_size", "logits_shift")


# ----------------------------------------------------------------------------- config (contract 1)
def dllm_config(config: ModelConfig, *, mask_id: int, attention: str = "bidirectional",
                block_size: int = 0, logits_shift: int = 0) -> ModelConfig:
    """`config` as a dLLM: the fields mask_token_id / attention / block_size / logits_shift set."""
    check_diffusion_options(config.vocab_size, mask_id, attention, block_size, logits_shift)
    return config.replace(mask_token_id=int(mask_id), attention=attention, block_size=int(block_size),
                          logits_shift=int(logits_shift))


def diffusion_options(config: ModelConfig) -> dict:
    """The dLLM fields of a config (defaults: a causal model)."""
    defaults = {"mask_token_id": None, "attention": "causal", "block_size": 0, "logits_shift": 0}
    return {k: getattr(config, k, d) for k, d in defaults.items()}


def check_diffusion_options(vocab_size: int, mask_id, attention: str, block_size: int, logits_shift: int):
    if attention not in ATTENTIONS:
        raise TrainConfigError(f"attention must be one of {ATTENTIONS} for a diffusion LM, got {attention!r}")
    if attention == "block" and block_size < 1:
        raise TrainConfigError(f"attention='block' needs block_size >= 1 (tokens per block), got {block_size}")
    if attention != "block" and block_size:
        raise TrainConfigError(f"block_size={block_size} only applies to attention='block'; drop it or "
                               f"use --attention block")
    if mask_id is None or not 0 <= int(mask_id) < vocab_size:
        raise TrainConfigError(f"mask id {mask_id!r} is not a token of the {vocab_size}-token vocabulary; "
                               f"add a MASK token (add_mask_token) or pass its id")
    if logits_shift not in (0, 1):
        raise TrainConfigError(f"logits_shift must be 0 or 1, got {logits_shift}")


# ----------------------------------------------------------------------------- the module
def block_ids(t: int, block_size: int, offset=0) -> jax.Array:
    """int32[B, T] (or [T]): the attention block of each position, blocks of `block_size` counted from
    `offset` (int or int[B]: the answer's start, as the decoders align them; positions before it fall
    in negative blocks, so the prompt's last block ends where the answer begins)."""
    pos = jnp.arange(t, dtype=jnp.int32) - jnp.asarray(offset, jnp.int32)[..., None]
    return jnp.floor_divide(pos, block_size)


def block_training_mask(blk) -> jax.Array:
    """bool[B, 2T, 2T] over [noisy ; clean] from block ids int32[B, T]: noisy block b sees noisy block b
    and clean blocks < b; clean block b sees clean blocks <= b; clean never sees noisy."""
    same = blk[:, :, None] == blk[:, None, :]
    before = blk[:, None, :] < blk[:, :, None]
    upto = blk[:, None, :] <= blk[:, :, None]
    top = jnp.concatenate([same, before], axis=2)
    bottom = jnp.concatenate([jnp.zeros_like(same), upto], axis=2)
    return jnp.concatenate([top, bottom], axis=1)


class DiffusionLM(CausalLM):
    """CausalLM's parameters and forward, with diffusion attention (static `attention`, `block_size`)."""

    def __init__(self, config: ModelConfig, params, compute_dtype: str = "float32", *,
                 attention: str = "bidirectional", block_size: int = 0):
        super().__init__(config, params, compute_dtype)
        check_diffusion_options(config.vocab_size, 0, attention, block_size, 0)
        self.attention = attention
        self.block_size = block_size

    def _forward(self, tokens, positions, mask):
        from .lm import COMPUTE_DTYPES
        dt = COMPUTE_DTYPES[self.compute_dtype]
        params = jax.tree.map(lambda a: a.astype(dt), self.raw_params())
        logits, _, _ = forward(self.config, params, tokens, positions, None, mask)
        return logits

    def __call__(self, tokens, clean=None, offset=0):
        """Logits [B, T, V] of `tokens` (bidirectional); block form: (noisy logits, clean logits) of
        [tokens ; clean] under `block_training_mask`, blocks counted from `offset` (int or int[B])."""
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if self.attention == "bidirectional":
            return self._forward(tokens, pos, jnp.ones((b, t, t), bool))
        if clean is None:
            raise ValueError("the block form trains on [noisy ; clean]: pass clean= (the unmasked tokens)")
        blk = jnp.broadcast_to(block_ids(t, self.block_size, offset), (b, t))
        mask = block_training_mask(blk)
        logits = self._forward(jnp.concatenate([tokens, clean], 1), jnp.concatenate([pos, pos], 1), mask)
        return logits[:, :t], logits[:, t:]


# ----------------------------------------------------------------------------- objective
def mask_tokens(key, tokens, maskable, mask_id: int, eps: float = 1e-3, block_size: int = 0, offset=0):
    """The forward process: (noisy int32[B, T], masked bool[B, T], t f32[B, T]).

    t ~ U(eps, 1) per row (per attention block when block_size > 0: blocks counted from `offset`, see
    block_ids); each maskable token becomes `mask_id` with probability t. `t` is each token's own noise
    level (its row's or its block's)."""
    b, n = tokens.shape
    k_t, k_m = jax.random.split(key)
    if block_size <= 0:
        t = jnp.broadcast_to(jax.random.uniform(k_t, (b, 1), minval=eps, maxval=1.0), (b, n))
    else:  # one draw per block id; ids lie in [-(n // block_size) - 1, n // block_size]
        span = n // block_size + 2
        draws = jax.random.uniform(k_t, (b, 2 * span), minval=eps, maxval=1.0)
        blk = jnp.broadcast_to(block_ids(n, block_size, offset), (b, n))
        t = jnp.take_along_axis(draws, blk + span, axis=1)
    masked = (jax.random.uniform(k_m, (b, n)) < t) & (maskable > 0)
    return jnp.where(masked, mask_id, tokens).astype(jnp.int32), masked, t


def shift_logits(logits, logits_shift: int):
    """The logits predicting each position j: logits[j - shift] (position 0 of a shifted model gets
    zeros: it is never scored)."""
    if logits_shift == 0:
        return logits
    return jnp.concatenate([jnp.zeros_like(logits[:, :1]), logits[:, :-1]], axis=1)


def masked_diffusion_loss(logits, tokens, masked, t, maskable):
    """LLaDA's loss: per row sum_{masked i} CE_i / t_i over its maskable count; mean over rows with
    any maskable token. logits [B, T, V] already predict position i at i. Returns (loss, aux)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
    m = masked.astype(jnp.float32)
    n_maskable = jnp.sum(maskable.astype(jnp.float32), axis=1)
    per_row = jnp.sum(ce * m / t, axis=1) / jnp.maximum(n_maskable, 1.0)
    rows = (n_maskable > 0).astype(jnp.float32)
    loss = jnp.sum(per_row * rows) / jnp.maximum(jnp.sum(rows), 1.0)
    n_masked = jnp.sum(m)
    acc = jnp.sum((jnp.argmax(logits, -1) == tokens) * m) / jnp.maximum(n_masked, 1.0)
    return loss, {"tokens": n_masked, "masked_ce": jnp.sum(ce * m) / jnp.maximum(n_masked, 1.0),
                  "masked_accuracy": acc}


@dataclasses.dataclass(frozen=True)
class DLLMLoss:
    """Trainer loss_fn of a dLLM. batch: tokens int32[B, T], maskable [B, T] (1: may be masked and
    scored), seed int32[B] (the row's noise: the same batch always gets the same masks)."""
    mask_id: int
    eps: float = 1e-3
    logits_shift: int = 0

    def outputs(self, module, batch):
        tokens, seed = batch["tokens"], batch["seed"]
        maskable = batch["maskable"] > 0
        offset = jnp.argmax(maskable, axis=1).astype(jnp.int32)  # blocks start where the answer does
        if self.logits_shift:  # position 0 has no logit before it
            maskable = maskable.at[:, 0].set(False)
        block = module.block_size if module.attention == "block" else 0
        keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.PRNGKey(0x5EED), s))(seed)
        noisy, masked, t = jax.vmap(
            lambda k, x, m, o: jax.tree.map(lambda a: a[0], mask_tokens(k, x[None], m[None], self.mask_id,
                                                                        self.eps, block, o)))(
            keys, tokens, maskable, offset)
        if block:
            noisy_logits, clean_logits = module(noisy, clean=tokens, offset=offset)
            logits = noisy_logits
            if self.logits_shift:  # a block's first token: from the clean (cached) token before it
                pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] - offset[:, None]
                starts = (pos % block == 0)[:, :, None]
                logits = jnp.where(starts, shift_logits(clean_logits, 1), shift_logits(noisy_logits, 1))
        else:
            logits = shift_logits(module(noisy), self.logits_shift)
        return logits, tokens, masked, t, maskable

    def __call__(self, module, batch, constants=None):
        return masked_diffusion_loss(*self.outputs(module, batch))


def dllm_eval_step(loss: DLLMLoss):
    """An eval_step for the trainer: (sum of the rows' losses, rows with maskable tokens)."""
    return functools.partial(_eval_step, loss)


def _eval_step(loss, module, batch, constants=None):
    value, _ = loss(module, batch)
    rows = jnp.sum((jnp.sum(batch["maskable"], axis=1) > 0).astype(jnp.float32))
    return value * rows, rows


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class TaskBatches:
    """SFT batches of one task or a mix (each row draws its task uniformly): prompt + answer, only the
    answer maskable; batch `step` depends only on (seed, step). Mixed tasks need equal prompt and
    answer lengths (one model learns them all: the prompt's tag says which)."""
    tasks: Task | tuple
    batch_size: int
    seed: int = 0

    def __post_init__(self):
        tasks = self.tasks if isinstance(self.tasks, tuple) else (self.tasks,)
        object.__setattr__(self, "tasks", tasks)
        shapes = {(t.prompt_length, t.answer_length, t.num_values) for t in tasks}
        if not tasks or len(shapes) != 1:
            raise TrainConfigError(f"mixed tasks must share prompt length, answer length and num_values; "
                                   f"got {[(t.name, t.prompt_length, t.answer_length, t.num_values) for t in tasks]}")

    def __call__(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        which = rng.integers(len(self.tasks), size=self.batch_size)
        rows = [self.tasks[w].sample(rng, 1) for w in which]
        prompts = np.concatenate([p for p, _ in rows])
        answers = np.concatenate([a for _, a in rows])
        tokens = np.concatenate([prompts, answers], axis=1)
        maskable = np.zeros(tokens.shape, np.float32)
        maskable[:, prompts.shape[1]:] = 1.0
        seed = (np.int64(step) * self.batch_size + np.arange(self.batch_size)) % (2**31 - 1)
        return {"tokens": tokens, "maskable": maskable, "seed": seed.astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class CorpusBatches:
    """Pre-training batches: windows of a corpus (training.corpus.WindowSampler), every real token
    maskable; `eval`: the held-out windows of training.corpus.eval_batches (weights -> maskable)."""
    sampler: object

    def __call__(self, step: int) -> dict:
        return to_dllm_batch(self.sampler(step), step)


def to_dllm_batch(lm_batch: dict, step: int) -> dict:
    """A causal-LM batch {tokens [B, T+1], weights [B, T]} as a dLLM batch over its first T tokens."""
    tokens = lm_batch["tokens"][:, :-1]
    b = tokens.shape[0]
    seed = (np.int64(step) * b + np.arange(b)) % (2**31 - 1)
    return {"tokens": tokens, "maskable": lm_batch["weights"].astype(np.float32), "seed": seed.astype(np.int32)}


# ----------------------------------------------------------------------------- MASK token
def add_mask_token(tokenizer, config: ModelConfig, params) -> tuple[object, ModelConfig, dict, int]:
    """(tokenizer, config, params, mask id) with a MASK token: the tokenizer's own mask token when it
    has one that fits the vocabulary, else a new special token <|mask|> at id = len(tokenizer), the
    model grown to hold it when needed (new embedding row / LM-head column = the mean of the others)."""
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and mid < config.vocab_size:
        return tokenizer, config, params, int(mid)
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    mid = int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    if mid < config.vocab_size:
        return tokenizer, config, params, mid
    grow = mid + 1 - config.vocab_size
    params = dict(params)
    emb = jnp.asarray(params["embed"])
    params["embed"] = jnp.concatenate([emb, jnp.repeat(emb.mean(0, keepdims=True), grow, 0)], 0)
    if "lm_head" in params and not config.tie_word_embeddings:
        head = jnp.asarray(params["lm_head"])  # [D, V]
        params["lm_head"] = jnp.concatenate([head, jnp.repeat(head.mean(1, keepdims=True), grow, 1)], 1)
    return tokenizer, config.replace(vocab_size=mid + 1), params, mid


def task_tokenizer(vocab: TaskVocab):
    """A word-level tokenizer of a task vocabulary (one token per id, whitespace-separated), so a task
    model exports as a loadable HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    names = vocab.token_strings()
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>",
                                   mask_token="<mask>", sep_token="<sep>")


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass(frozen=True)
class DLLMSpec:
    """How a dLLM trains (the run identity of a resumed run holds it)."""
    attention: str = "bidirectional"
    block_size: int = 0
    logits_shift: int = 0
    eps: float = 1e-3
    batch_size: int = 32
    compute_dtype: str = "float32"


def train_dllm(config: ModelConfig, params, batches, train_config: TrainConfig, workdir, *, mask_id: int,
               spec: DLLMSpec = DLLMSpec(), eval_batches=None, run_info: dict | None = None,
               on_eval=None):
    """Train a dLLM with the shared trainer; returns (TrainResult, the dLLM's ModelConfig).

    `params`: the initial params (random, or a causal LM's for continued training); `batches(step)`
    gives dLLM batches (TaskBatches, CorpusBatches)."""
    out_config = dllm_config(config, mask_id=mask_id, attention=spec.attention, block_size=spec.block_size,
                             logits_shift=spec.logits_shift)
    module = DiffusionLM(config, params, spec.compute_dtype, attention=spec.attention,
                         block_size=spec.block_size)
    loss = DLLMLoss(mask_id=int(mask_id), eps=spec.eps, logits_shift=spec.logits_shift)
    info = {"model": config.to_hf_dict(), "dllm": dataclasses.asdict(spec), "mask_id": int(mask_id),
            **(run_info or {})}
    result = train(module, loss, batches, train_config, workdir,
                   eval_step=dllm_eval_step(loss) if eval_batches else None,
                   eval_batches=(lambda: eval_batches) if eval_batches else None,
                   run_info=json.loads(json.dumps(info)), on_eval=on_eval)
    return result, out_config


# Width 128 is what learns permutation's coupling (no value twice) in ~250 steps; width 64 plateaus.
TASK_MODEL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=32, tie_word_embeddings=True)


def task_model_config(task: Task, **shape) -> ModelConfig:
    """A small llama-shaped model over the task vocabulary (EOS = the task EOS)."""
    vocab = task.vocab
    seq = task.prompt_length + task.answer_length
    base = model_config("tiny", vocab.size, max_positions=max(64, 1 << (seq - 1).bit_length()),
                        eos_token_id=vocab.eos_id)
    return base.replace(**{**TASK_MODEL_SHAPE, **shape})


def train_task_dllm(tasks: Task | tuple, workdir, *, steps: int = 300, batch_size: int = 32,
                    learning_rate: float = 3e-3, seed: int = 0, spec: DLLMSpec | None = None, export_dir=None,
                    progress: bool = False, train_config: TrainConfig | None = None, **shape):
    """Train a small dLLM on a task or a mix of tasks (SFT: the prompt is never masked); returns
    (config, params). Rerunning with the same `workdir` resumes (or just reloads a finished run).
    `train_config` replaces the one built from steps / learning_rate / seed / progress; `spec`'s
    batch_size replaces `batch_size`.

    `export_dir`: also write an HF directory (config.json with the dLLM fields, safetensors and a
    word-level tokenizer of the task vocabulary)."""
    spec = spec or DLLMSpec(batch_size=batch_size)
    tcfg = train_config or TrainConfig(steps=steps, learning_rate=learning_rate, warmup_steps=min(20, steps - 1),
                                       weight_decay=0.0, seed=seed, log_every=max(steps // 10, 1), eval_every=0,
                                       checkpoint_every=0, keep_checkpoints=1, data_parallel=1, progress=progress)
    seed = tcfg.seed
    data = TaskBatches(tasks, spec.batch_size, seed)
    config = task_model_config(data.tasks[0], **shape)
    from jaxdecode.models import init_params
    params = init_params(config, jax.random.PRNGKey(seed))
    tasks_info = [[t.name, t.length, t.num_values] + ([t.options] if t.options else []) for t in data.tasks]
    result, out_config = train_dllm(config, params, data, tcfg, workdir, mask_id=data.tasks[0].vocab.mask_id,
                                    spec=spec, run_info={"tasks": tasks_info})
    params = result.module.raw_params()
    if export_dir is not None:
        export_lm(out_config, params, task_tokenizer(data.tasks[0].vocab), export_dir)
    return out_config, params


@functools.lru_cache(maxsize=8)
def tiny_task_dllm(names: str | tuple = "permutation", length: int = 6, num_values: int = 6, steps: int = 300,
                   batch_size: int = 32, seed: int = 0, logits_shift: int = 0):
    """A trained tiny task dLLM (config, params) for tests, cached per process: one task (or a tuple of
    task names, mixed) over `num_values` values (bidirectional; logits_shift 1: Dream-style). Models of
    equal shape share the compiled train step, so a second task costs only its steps."""
    import tempfile

    from jaxdecode.dllm_tasks import make_task
    names = (names,) if isinstance(names, str) else tuple(names)
    with tempfile.TemporaryDirectory() as tmp:
        return train_task_dllm(tuple(make_task(n, length, num_values) for n in names), Path(tmp), steps=steps,
                               seed=seed, spec=DLLMSpec(batch_size=batch_size, logits_shift=logits_shift))


def train_corpus_dllm(corpus_dir, tokenizer_dir, train_config: TrainConfig, workdir, *, spec: DLLMSpec = DLLMSpec(),
                      seq_len: int = 256, size: str = "small", max_positions: int = 512, init_from=None,
                      export_dir=None, export_dtype: str | None = None, eval_max_batches: int | None = 8):
    """Pre-train a dLLM on a corpus (every token maskable: continuation and infilling), from scratch or
    continued from a causal LM (`init_from`: an HF directory with the corpus's tokenizer; its
    architecture is kept, `size` / `max_positions` then do not apply). The tokenizer gets a MASK token
    when it has none (add_mask_token). Returns (TrainResult, the dLLM's ModelConfig)."""
    from jaxdecode.models import init_params, load_params

    from .corpus import Corpus, WindowSampler, eval_batches
    from .tokenizer import check_vocab, eos_id, load_tokenizer_dir
    corpus = Corpus.open(corpus_dir)
    tokenizer = load_tokenizer_dir(tokenizer_dir)
    corpus.check_tokenizer(tokenizer)  # before the MASK token changes its fingerprint
    if init_from is not None:
        config, params = load_params(init_from, dtype="float32")
        if getattr(config, "is_diffusion", False):
            raise TrainConfigError(f"--init-from {init_from} is already a diffusion LM; continued training "
                                   f"starts from a causal LM")
        init_info = str(Path(init_from).resolve())
    else:
        config = model_config(size, len(tokenizer), max_positions, eos_id(tokenizer))
        params, init_info = init_params(config, jax.random.PRNGKey(train_config.seed)), None
    check_vocab(tokenizer, config.vocab_size)
    if seq_len > config.max_position_embeddings:
        raise TrainConfigError(f"seq_len={seq_len} exceeds the model's max_position_embeddings="
                               f"{config.max_position_embeddings}")
    tokenizer, config, params, mask_id = add_mask_token(tokenizer, config.replace(dtype="float32"), params)
    sampler = WindowSampler(corpus.tokens("train"), spec.batch_size, seq_len, train_config.seed)
    held = [to_dllm_batch(b, i) for i, b in enumerate(
        eval_batches(corpus.tokens("heldout"), spec.batch_size, seq_len, eval_max_batches))]
    info = {"corpus": corpus.manifest["tokenizer_fingerprint"] + f":{len(sampler.tokens)}", "seq_len": seq_len,
            "init": init_info}
    result, out_config = train_dllm(config, params, CorpusBatches(sampler), train_config, workdir, mask_id=mask_id,
                                    spec=spec, eval_batches=held, run_info=info)
    if export_dir is not None:
        export_lm(out_config, result.module.raw_params(), tokenizer, export_dir, dtype=export_dtype)
    return result, out_config


def plot_dllm_training(metrics: list[dict], path, title: str = "dLLM"):
    """The masked-diffusion loss (train, held-out) and the masked-token accuracy over steps, one figure.
    Returns its path, or None when there is nothing to plot or matplotlib is not installed (skipped with a
    warning)."""
    if not metrics:
        return None
    from .drafters import plot_loss, pyplot
    plt = pyplot(path)
    if plt is None:
        return None
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
    plot_loss(ax_l, metrics, title)
    acc = [(m["step"], m["masked_accuracy"]) for m in metrics if "masked_accuracy" in m]
    if acc:
        ax_a.plot(*zip(*acc), color="tab:green", lw=1)
    ax_a.set(xlabel="step", ylabel="accuracy", title="masked-token accuracy (train batches)", ylim=(0, 1.02))
    for ax in (ax_l, ax_a):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
