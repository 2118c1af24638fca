"""Causal-LM training: from scratch or distilled from a teacher's logits, exported in HF format.

The network is the pure `jaxdecode.models.forward`; `CausalLM` only holds its parameter pytree as
`nnx.Param` leaves (master weights in float32) and casts them to the compute dtype on the way in,
so bf16 compute keeps float32 optimizer state.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdecode.models import ModelConfig, causal_mask, forward, init_params, load_params, save_params

from .corpus import Corpus, WindowSampler, eval_batches
from .files import save_whole
from .tokenizer import TokenizerError, check_vocab, load_tokenizer_dir
from .trainer import TrainConfig, TrainConfigError, train

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _is_var(x):
    return isinstance(x, nnx.Variable)


class CausalLM(nnx.Module):
    """A trainable view of `forward(config, params, ...)` with causal attention and no cache."""

    def __init__(self, config: ModelConfig, params, compute_dtype: str = "float32"):
        if compute_dtype not in COMPUTE_DTYPES:
            raise TrainConfigError(f"compute_dtype must be one of {sorted(COMPUTE_DTYPES)}, "
                                   f"got {compute_dtype!r}")
        self.config = config.replace(dtype="float32")
        self.compute_dtype = compute_dtype
        self.params = nnx.data(jax.tree.map(lambda a: nnx.Param(jnp.asarray(a, jnp.float32)), params))

    def raw_params(self):
        return jax.tree.map(lambda v: v[...], self.params, is_leaf=_is_var)

    def __call__(self, tokens):
        b, t = tokens.shape
        dt = COMPUTE_DTYPES[self.compute_dtype]
        params = jax.tree.map(lambda a: a.astype(dt), self.raw_params())
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _, _ = forward(self.config, params, tokens, positions, None, causal_mask(b, t))
        return logits


# ----------------------------------------------------------------------------- losses
def _nll(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def lm_loss(module, batch, constants=None):
    """Mean next-token cross-entropy over weighted positions. batch: tokens [B, T+1], weights [B, T]."""
    toks = batch["tokens"]
    w = batch["weights"]
    nll = _nll(module(toks[:, :-1]), toks[:, 1:])
    n = jnp.sum(w)
    return jnp.sum(nll * w) / jnp.maximum(n, 1.0), {"tokens": n}


def lm_eval_step(module, batch, constants=None):
    toks = batch["tokens"]
    nll = _nll(module(toks[:, :-1]), toks[:, 1:])
    return jnp.sum(nll * batch["weights"]), jnp.sum(batch["weights"])


@dataclasses.dataclass(frozen=True)
class DistillLoss:
    """alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE; the teacher is `constants`."""
    teacher_config: ModelConfig
    temperature: float = 1.0
    alpha: float = 1.0

    def __call__(self, module, batch, teacher_params):
        toks = batch["tokens"][:, :-1]
        w = batch["weights"]
        b, t = toks.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        t_logits, _, _ = forward(self.teacher_config, teacher_params, toks, pos, None, causal_mask(b, t))
        t_logits = jax.lax.stop_gradient(t_logits)
        s_logits = module(toks)
        tau = self.temperature
        t_logp = jax.nn.log_softmax(t_logits / tau, axis=-1)
        s_logp = jax.nn.log_softmax(s_logits / tau, axis=-1)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1) * tau ** 2
        ce = _nll(s_logits, batch["tokens"][:, 1:])
        n = jnp.maximum(jnp.sum(w), 1.0)
        loss = jnp.sum((self.alpha * kl + (1 - self.alpha) * ce) * w) / n
        return loss, {"tokens": jnp.sum(w), "kl": jnp.sum(kl * w) / n, "ce": jnp.sum(ce * w) / n}


# ----------------------------------------------------------------------------- model sizes
def model_config(size: str, vocab_size: int, max_positions: int = 512, eos_token_id: int = 0) -> ModelConfig:
    """Named llama-style sizes: 'tiny' (tests), 'draft' (~2.5 M), 'small' (~12 M), 'base' (~30 M)."""
    shapes = {
        "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, tie_word_embeddings=True),
        "draft": dict(hidden_size=192, intermediate_size=512, num_layers=4, num_heads=3,
                      num_kv_heads=1, head_dim=64, tie_word_embeddings=True),
        "small": dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
                      num_kv_heads=2, head_dim=64, tie_word_embeddings=False),
        "base": dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                     num_kv_heads=2, head_dim=64, tie_word_embeddings=False),
    }
    if size not in shapes:
        raise TrainConfigError(f"unknown model size {size!r}; choose one of {sorted(shapes)}")
    return ModelConfig(model_type="llama", vocab_size=vocab_size, max_position_embeddings=max_positions,
                       bos_token_id=eos_token_id, eos_token_ids=(eos_token_id,),
                       pad_token_id=eos_token_id, norm_eps=1e-5, **shapes[size])


# ----------------------------------------------------------------------------- train + export
@dataclasses.dataclass(frozen=True)
class LMTrainSpec:
    batch_size: int = 16
    seq_len: int = 256
    compute_dtype: str = "float32"
    eval_batch_size: int = 16
    eval_max_batches: int | None = 8  # periodic held-out evaluation: the first N batches (0: none)
    distill_temperature: float = 1.0
    distill_alpha: float = 1.0


def train_lm(corpus_dir, tokenizer_dir, config: ModelConfig, train_config: TrainConfig, workdir, *,
             spec: LMTrainSpec = LMTrainSpec(), teacher_dir=None, export_dir=None,
             export_dtype: str | None = None, init_from=None, init_info: str | None = None,
             batches=None, data_info: str | None = None, on_eval=None):
    """Train a causal LM on a corpus (optionally distilling a teacher), optionally export it.

    `batches(step)` ({"tokens" [B, T+1], "weights" [B, T]}, a pure function of the step) replaces the
    corpus's training windows (e.g. the target's own continuations); `data_info` names that data in
    the run identity. The corpus still gives the held-out evaluation. `on_eval`: see trainer.train.
    `init_from`: start from these params (a pytree, or an HF directory of a model with this
    config) instead of a random init: continued training with a fresh optimizer and schedule.
    `init_info` names the starting point in the run identity (default: the directory).
    Returns the trainer's `TrainResult`; `result.module.raw_params()` are the trained params.
    """
    corpus = Corpus.open(corpus_dir)
    tokenizer = load_tokenizer_dir(tokenizer_dir)
    corpus.check_tokenizer(tokenizer)
    check_vocab(tokenizer, config.vocab_size)
    if spec.seq_len > config.max_position_embeddings:
        raise TrainConfigError(f"seq_len={spec.seq_len} exceeds the model's max_position_embeddings="
                               f"{config.max_position_embeddings}")
    n_data = train_config.data_parallel or jax.device_count()
    for name, bs in (("batch_size", spec.batch_size), ("eval_batch_size", spec.eval_batch_size)):
        if bs % n_data:
            raise TrainConfigError(f"{name}={bs} must be a multiple of the {n_data} data-parallel "
                                   f"devices; change it or set data_parallel")
    loss_fn, constants, teacher_info = lm_loss, None, None
    if teacher_dir is not None:
        t_config, t_params = load_params(teacher_dir, dtype="float32")
        if t_config.vocab_size != config.vocab_size:
            raise TokenizerError(f"tokenizer/model vocabulary mismatch: the teacher {teacher_dir} has "
                                 f"vocab_size={t_config.vocab_size}, the student {config.vocab_size}; "
                                 f"distillation needs the same vocabulary")
        loss_fn = DistillLoss(t_config, spec.distill_temperature, spec.distill_alpha)
        constants, teacher_info = t_params, str(Path(teacher_dir).resolve())

    train_tokens = corpus.tokens("train")
    heldout = corpus.tokens("heldout")
    sampler = batches or WindowSampler(train_tokens, spec.batch_size, spec.seq_len, train_config.seed)
    eval_set = eval_batches(heldout, spec.eval_batch_size, spec.seq_len, spec.eval_max_batches)

    params = init_params(config.replace(dtype="float32"), jax.random.PRNGKey(train_config.seed))
    if init_from is not None:
        if isinstance(init_from, (str, Path)):
            init_config, init = load_params(init_from, dtype="float32")
            init_info = init_info or str(Path(init_from).resolve())
            if init_config.replace(extra=(), dtype="float32") != config.replace(extra=(), dtype="float32"):
                raise TrainConfigError(f"--init-from {init_from} holds a different architecture "
                                       f"({init_config}) than the model to train ({config})")
        else:
            init = init_from
        want = jax.tree.map(lambda a: a.shape, params)
        got = jax.tree.map(lambda a: a.shape, init)
        if want != got:
            raise TrainConfigError(f"initial params do not fit the model: {got} vs {want}")
        params = init
    module = CausalLM(config, params, spec.compute_dtype)
    run_info = {"model": config.to_hf_dict(), "spec": dataclasses.asdict(spec),
                "corpus": corpus.manifest["tokenizer_fingerprint"] + f":{len(train_tokens)}",
                "teacher": teacher_info}
    if init_from is not None:  # only then, so plain runs keep their identity
        run_info["init"] = init_info or "params"
    if batches is not None:
        run_info["data"] = data_info or "batches"
    result = train(module, loss_fn, sampler, train_config, workdir,
                   eval_step=lm_eval_step if eval_set else None, eval_batches=lambda: eval_set,
                   constants=constants, run_info=run_info, on_eval=on_eval)
    if export_dir is not None:
        export_lm(config, result.module.raw_params(), tokenizer, export_dir, dtype=export_dtype)
    return result


def export_lm(config: ModelConfig, params, tokenizer, out_dir, dtype: str | None = None) -> Path:
    """config.json + safetensors + tokenizer files: loadable by jaxdecode and by transformers.

    Written whole or not at all (`save_whole`): a failed export leaves an earlier one as it was.
    Files of an existing `out_dir` that the export does not write are kept, except old weights.
    """
    out_dir = Path(out_dir)

    def write(tmp: Path):
        save_params(config, params, tmp, dtype=dtype or config.dtype)
        tokenizer.save_pretrained(str(tmp))
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
               "pad_token_id": config.pad_token_id}
        with open(tmp / "generation_config.json", "w") as f:
            json.dump(gen, f, indent=2)
        _keep_other_files(out_dir, tmp)
    return save_whole(out_dir, write)


_OLD_WEIGHTS = ("model*.safetensors", "model.safetensors.index.json")


def _keep_other_files(old: Path, new: Path) -> None:
    """Copy what `old` holds and `new` does not (a model card, notes) into `new`, old weights aside."""
    if not old.is_dir():
        return
    weights = {p.name for pat in _OLD_WEIGHTS for p in old.glob(pat)}
    for p in old.iterdir():
        if p.name in weights or (new / p.name).exists():
            continue
        if p.is_dir():
            shutil.copytree(p, new / p.name, symlinks=True)
        else:
            shutil.copy2(p, new / p.name)


def evaluate_heldout(config: ModelConfig, params, batches, byte_lengths: np.ndarray) -> dict:
    """nats/token and bits/byte over the weighted positions of held-out batches (see eval_batches).

    bits/byte divides the total by ln 2 and by the UTF-8 bytes of the scored tokens
    (`byte_lengths[token]`, from baselines.token_byte_lengths), so a subset is scored exactly.
    """
    module = CausalLM(config, params)
    graphdef, state = nnx.split(module)

    @jax.jit
    def step(state, batch):
        return lm_eval_step(nnx.merge(graphdef, state), batch)

    tot, n, n_bytes = 0.0, 0.0, 0
    for b in batches:
        ls, ws = step(state, b)
        tot += float(ls)
        n += float(ws)
        n_bytes += int((byte_lengths[b["tokens"][:, 1:]] * (b["weights"] > 0)).sum())
    return {"nats_per_token": tot / n, "bits_per_byte": tot / math.log(2) / n_bytes,
            "tokens": int(n), "bytes": n_bytes}
