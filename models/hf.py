"""Hugging Face checkpoints: config.json + (sharded) safetensors <-> (ModelConfig, params).

Weights are validated on load: a missing tensor, a tensor of the wrong shape, or an unexpected
tensor is an error that names it. Saving writes config.json in the transformers 5.x form plus the
4.x keys (`rope_theta`, `torch_dtype`), so both lines of transformers read what we write.

Masked-diffusion LM layouts (config.model_type; the network is the llama family's, the attention
mask the decoder's business, see ModelConfig.attention):
  - "llada": LLaDA-8B-Base/-Instruct (GSAI-ML; modeling_llada.py). Its own config.json keys (d_model,
    n_heads, n_kv_heads, n_layers, mlp_hidden_size, embedding_size, weight_tying, mask_token_id, ...)
    and tensor names model.transformer.{wte, blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out,
    ff_norm, ff_proj (the SiLU-gated one), up_proj, ff_out}, ln_f, ff_out}. Bidirectional.
  - "Dream": Dream-v0-Base/-Instruct-7B (Dream-org): Qwen2's keys and tensor names (q/k/v biases) plus
    mask_token_id; bidirectional, logits shifted by one (logits_shift=1: trained from Qwen2.5).
  - "Fast_dLLM_Qwen": Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_1.5B/7B): a Qwen2.5 checkpoint
    plus `bd_size`; block diffusion (attention="block", block_size=bd_size), logits shifted by one.
    Its config.json has no mask id (the tokenizer's "|<MASK>|" token is the MASK): `load_params` takes
    it from the tokenizer files in the directory when config.json has no mask_token_id.
  - a transformers layout (llama, qwen2, mistral, gpt2) whose config.json says `diffusion_attention`
    ("bidirectional" | "block"), `bd_size`, `mask_token_id`, `logits_shift`: what `save_params` writes
    for a diffusion model of those types (e.g. one trained by jaxdecode.training).
BD3-LM (kuleshov-group/bd3lm-*) is a DiT with timestep conditioning and its own names: not a llama
network, so not loadable here; its block-causal attention is what attention="block" computes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .config import LLADA_TYPE, ConfigError, ModelConfig
from .transformer import param_shapes


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or holds tensors that do not fit its config."""


# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut to `limit` characters (errors print as one line)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object; anything else is a CheckpointError naming the file."""
    try:
        with open(file, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                              f"fix it or re-download the checkpoint") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON (not UTF-8: {e.reason} at byte {e.start}); "
                              f"fix it or re-download the checkpoint") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file} must hold a JSON object ({{...}}), found a JSON "
                              f"{_JSON_KINDS.get(type(obj), type(obj).__name__)}; fix it or re-download "
                              f"the checkpoint")
    return obj


def read_config(path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a Hugging Face checkpoint directory")
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    cfg = read_json_object(cfg_file)
    gen = path / "generation_config.json"
    if gen.exists() and cfg.get("eos_token_id") is None:
        eos = read_json_object(gen).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


# Vision-language checkpoints whose language model loads alone (as its text-only layout): model_type ->
# the text model's model_type, tensor-name prefixes of the language model -> the text model's, and the
# prefixes of the parts left unread (the vision tower, the projector).
_TEXT_TOWERS = {
    "gemma3": dict(text_type="gemma3_text",
                   prefixes={"language_model.model.": "model.", "model.language_model.": "model.",
                             "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."},
                   unread=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                           "model.multi_modal_projector.")),
}


def _text_config(cfg: dict, path: Path) -> dict:
    """A vision-language config.json -> its language model's config in the text layout's form. The
    released ones list only what differs from transformers' defaults there, which the text layout's
    family defaults fill in as for a text-only checkpoint."""
    tower = _TEXT_TOWERS[cfg["model_type"]]
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path / 'config.json'} has model_type {cfg['model_type']!r} but no text_config "
                              f"object; fix it or re-download the checkpoint")
    text = dict(text, model_type=tower["text_type"])
    for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text  # the text layout's defaults fill in the rest (`ModelConfig.from_hf_dict`)


def _text_tensors(tensors: dict, model_type: str) -> dict:
    """The language model's tensors of a vision-language checkpoint, named as its text model's."""
    tower = _TEXT_TOWERS[model_type]
    out = {}
    for name, w in tensors.items():
        if name.startswith(tower["unread"]):
            continue
        prefix = next((p for p in tower["prefixes"] if name.startswith(p)), None)
        out[name if prefix is None else tower["prefixes"][prefix] + name[len(prefix):]] = w
    return out


def _tensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f'{index} has no "weight_map" object (tensor name -> shard file); '
                                  f"fix it or re-download the checkpoint")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(
        f"{path} has no model.safetensors or model.safetensors.index.json "
        f"(PyTorch .bin checkpoints are not supported: re-save with safe_serialization=True)")


# Bytes per element of the safetensors dtypes whose byte ranges are checked here; tensors of other
# dtypes (sub-byte floats, ...) are left to the safetensors reader.
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_MAX_HEADER = 100 << 20  # the safetensors reader's own limit
_REFETCH = "re-download or re-save the checkpoint"


def check_safetensors_file(file: Path) -> None:
    """Check a safetensors file's layout before reading it: an 8-byte little-endian header length, a
    JSON header, and tensors whose byte ranges match their dtype and shape and tile the data section.

    A truncated, foreign or inconsistent file is a CheckpointError naming the file and the problem
    (the reader's own errors name neither).
    """
    size = file.stat().st_size
    if size == 0:
        raise CheckpointError(f"{file} is not a safetensors file: it is empty; {_REFETCH}")
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        if len(head) < 8 or n < 2 or n > _ST_MAX_HEADER:
            raise CheckpointError(f"{file} is not a safetensors file: its first 8 bytes are not a header "
                                  f"length ({size} bytes in all); {_REFETCH}")
        if 8 + n > size:
            raise CheckpointError(f"{file} is truncated or not a safetensors file: its header should end "
                                  f"at byte {8 + n} but the file has {size} bytes; {_REFETCH}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is not a safetensors file: its header is not JSON "
                              f"({_one_line(e, 120)}); {_REFETCH}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is not a safetensors file: its header is not a JSON object; "
                              f"{_REFETCH}")
    data = size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
              and isinstance(info.get("shape"), list)
              and all(isinstance(x, int) and x >= 0 for x in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(isinstance(x, int) for x in info["data_offsets"])
              and 0 <= info["data_offsets"][0] <= info["data_offsets"][1])
        if not ok:
            raise CheckpointError(f"{file} has an inconsistent header: the entry of tensor {name!r} is "
                                  f"malformed ({_one_line(info, 120)}); {_REFETCH}")
        begin, end = info["data_offsets"]
        item = _ST_ITEMSIZE.get(info["dtype"])
        if item is not None:
            want = item * int(np.prod(info["shape"], dtype=np.int64))
            if want != end - begin:
                dims = ", ".join(map(str, info["shape"]))
                raise CheckpointError(
                    f"{file} has an inconsistent header: tensor {name!r} is {info['dtype']} [{dims}] "
                    f"({want} bytes) but its data_offsets span {end - begin} bytes; {_REFETCH}")
        entries.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(entries):
        if end > data:
            raise CheckpointError(f"{file} is truncated: tensor {name!r} ends at byte {8 + n + end} but "
                                  f"the file has {size} bytes; {_REFETCH}")
        if begin != pos:
            raise CheckpointError(f"{file} has an inconsistent header: tensor {name!r} starts at data "
                                  f"byte {begin}, expected {pos} (tensors must tile the data); {_REFETCH}")
        pos = end
    if pos != data:
        raise CheckpointError(f"{file} has {data - pos} bytes after its last tensor that its header does "
                              f"not describe (a damaged or partly overwritten file); {_REFETCH}")


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open
    out = {}
    for f in _tensor_files(path):
        check_safetensors_file(f)
        try:
            with safe_open(str(f), framework="flax") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k)
        except Exception as e:  # what the layout check cannot see (e.g. an unknown dtype)
            raise CheckpointError(f"{f} cannot be read as safetensors ({type(e).__name__}: "
                                  f"{_one_line(e)}); {_REFETCH}") from None
    return out


# LLaDA (modeling_llada.py: LLaDAModelLM.model.transformer) names the llama-family tensors its own way.
_LLADA_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm",
                      "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
                      "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
                      "mlp.down_proj": "ff_out"}
_LLADA_GLOBAL_NAMES = {"model.embed_tokens.weight": "model.transformer.wte.weight",
                       "model.norm.weight": "model.transformer.ln_f.weight",
                       "lm_head.weight": "model.transformer.ff_out.weight"}


def layout_name(config: ModelConfig, name: str) -> str:
    """A llama-family tensor name ("model.layers.3.mlp.up_proj.weight", "lm_head.weight") in the
    checkpoint layout of config.model_type: itself for the transformers layouts (llama, qwen2, mistral,
    and Dream / Fast-dLLM v2, which keep Qwen2's names), LLaDA's name for a LLaDA model
    ("model.transformer.blocks.3.up_proj.weight", "model.transformer.ff_out.weight")."""
    if config.model_type != LLADA_TYPE:
        return name
    if name in _LLADA_GLOBAL_NAMES:
        return _LLADA_GLOBAL_NAMES[name]
    parts = name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    module = ".".join(parts[3:-1])
    if parts[:2] != ["model", "layers"] or module not in _LLADA_LAYER_NAMES:
        raise KeyError(f"no LLaDA name for tensor {name!r}")
    return f"model.transformer.blocks.{parts[2]}.{_LLADA_LAYER_NAMES[module]}.{parts[-1]}"


def _hf_layer_map(config: ModelConfig, i: int) -> dict[str, tuple[str, callable, tuple]]:
    """HF tensor name -> (our layer param path, conversion from the HF tensor, HF shape) for layer i. A fused
    tensor (Phi-3's qkv_proj, gate_up_proj) maps to a tuple of our paths, its conversion to a tuple of parts.

    The HF shape is checked before converting: a reshape alone would accept a tensor of the right
    size but the wrong layout (e.g. a transposed k_proj) and load garbage silently.
    """
    d, h, kv, hd, f = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                       config.intermediate_size)
    p = f"model.layers.{i}."
    if config.post_norms:  # OLMo 2: the attention's and the MLP's outputs are normed, not their inputs
        m = {p + "post_attention_layernorm.weight": ("attn_out_norm/scale", lambda w: w, (d,)),
             p + "post_feedforward_layernorm.weight": ("mlp_out_norm/scale", lambda w: w, (d,))}
    elif config.sandwich_norms:  # Gemma 3: post_attention_layernorm is the attention output's norm
        m = {p + "input_layernorm.weight": ("attn_norm/scale", lambda w: w, (d,)),
             p + "post_attention_layernorm.weight": ("attn_out_norm/scale", lambda w: w, (d,)),
             p + "pre_feedforward_layernorm.weight": ("mlp_norm/scale", lambda w: w, (d,)),
             p + "post_feedforward_layernorm.weight": ("mlp_out_norm/scale", lambda w: w, (d,))}
    else:
        m = {p + "input_layernorm.weight": ("attn_norm/scale", lambda w: w, (d,))}
        if not config.parallel_block:  # Cohere's MLP reads the input norm's output too
            m[p + "post_attention_layernorm.weight"] = ("mlp_norm/scale", lambda w: w, (d,))
        if config.layer_norm:  # Phi-3.5-MoE's LayerNorms: a bias beside each scale
            m.update({p + "input_layernorm.bias": ("attn_norm/bias", lambda b: b, (d,)),
                      p + "post_attention_layernorm.bias": ("mlp_norm/bias", lambda b: b, (d,))})
    r = _to_halves(config)  # each head's last axis: HF's interleaved RoPE pairs -> our halves (Cohere)
    if config.model_type == "phi3":  # one fused q/k/v projection: rows q (h heads), then k, then v (kv heads)
        m[p + "self_attn.qkv_proj.weight"] = (("wq", "wk", "wv"), lambda w: (
            w[:h * hd].T.reshape(d, h, hd), w[h * hd:(h + kv) * hd].T.reshape(d, kv, hd),
            w[(h + kv) * hd:].T.reshape(d, kv, hd)), ((h + 2 * kv) * hd, d))
    else:
        m.update({
            p + "self_attn.q_proj.weight": ("wq", lambda w: r(w.T.reshape(d, h, hd)), (h * hd, d)),
            p + "self_attn.k_proj.weight": ("wk", lambda w: r(w.T.reshape(d, kv, hd)), (kv * hd, d)),
            p + "self_attn.v_proj.weight": ("wv", lambda w: w.T.reshape(d, kv, hd), (kv * hd, d)),
        })
    m[p + "self_attn.o_proj.weight"] = ("wo", lambda w: w.T.reshape(h, hd, d), (d, h * hd))
    if config.model_type == "phi3":  # one fused gate/up projection: the gate's rows first (chunk(2))
        m[p + "mlp.gate_up_proj.weight"] = (("w_gate", "w_up"), lambda w: (w[:f].T, w[f:].T), (2 * f, d))
        m[p + "mlp.down_proj.weight"] = ("w_down", lambda w: w.T, (d, f))
    elif config.model_type in _GRANITE_MOE:  # every expert in one tensor: [E, 2 Fm, D] (gate rows, then up), [E, D, Fm]
        fm, e, q = config.moe_intermediate_size, config.num_experts, p + "block_sparse_moe."
        m[q + "router.layer.weight"] = ("w_router", lambda w: w.T, (e, d))
        m[q + "input_linear.weight"] = (("we_gate", "we_up"), lambda w: (
            w[:, :fm].transpose(0, 2, 1), w[:, fm:].transpose(0, 2, 1)), (e, 2 * fm, d))
        m[q + "output_linear.weight"] = ("we_down", lambda w: w.transpose(0, 2, 1), (e, d, fm))
        fs = config.shared_expert_intermediate_size
        if fs:  # Granite-MoE-shared's dense shared MLP, its gate and up rows fused the same way; no sigmoid gate
            m[p + "shared_mlp.input_linear.weight"] = (("ws_gate", "ws_up"), lambda w: (w[:fs].T, w[fs:].T),
                                                       (2 * fs, d))
            m[p + "shared_mlp.output_linear.weight"] = ("ws_down", lambda w: w.T, (d, fs))
    elif config.num_experts:  # "we_gate[j]": expert j's slice of the stacked [E, ...] weight
        fm = config.moe_intermediate_size
        moe, (gate, up, down) = _MOE_NAMES[config.model_type]
        m[p + moe + ".gate.weight"] = ("w_router", lambda w: w.T, (config.num_experts, d))
        for j in range(config.num_experts):
            q = f"{p}{moe}.experts.{j}."
            m[q + gate + ".weight"] = (f"we_gate[{j}]", lambda w: w.T, (fm, d))
            m[q + up + ".weight"] = (f"we_up[{j}]", lambda w: w.T, (fm, d))
            m[q + down + ".weight"] = (f"we_down[{j}]", lambda w: w.T, (d, fm))
        fs = config.shared_expert_intermediate_size
        if fs:  # Qwen2-MoE's shared expert and its sigmoid gate ([1, D]: one logit per token)
            m.update({p + "mlp.shared_expert.gate_proj.weight": ("ws_gate", lambda w: w.T, (fs, d)),
                      p + "mlp.shared_expert.up_proj.weight": ("ws_up", lambda w: w.T, (fs, d)),
                      p + "mlp.shared_expert.down_proj.weight": ("ws_down", lambda w: w.T, (d, fs)),
                      p + "mlp.shared_expert_gate.weight": ("w_shared_gate", lambda w: w.T, (1, d))})
    else:
        m.update({p + "mlp.gate_proj.weight": ("w_gate", lambda w: w.T, (f, d)),
                  p + "mlp.up_proj.weight": ("w_up", lambda w: w.T, (f, d)),
                  p + "mlp.down_proj.weight": ("w_down", lambda w: w.T, (d, f))})
    if config.qkv_bias:
        m[p + "self_attn.q_proj.bias"] = ("bq", lambda b: r(b.reshape(h, hd)), (h * hd,))
        m[p + "self_attn.k_proj.bias"] = ("bk", lambda b: r(b.reshape(kv, hd)), (kv * hd,))
        m[p + "self_attn.v_proj.bias"] = ("bv", lambda b: b.reshape(kv, hd), (kv * hd,))
    if config.o_bias:
        m[p + "self_attn.o_proj.bias"] = ("bo", lambda b: b, (d,))
    if config.qk_norm_full:  # OLMo 2: over all heads ([H * hd]), kept per head as the projections are
        m[p + "self_attn.q_norm.weight"] = ("q_norm/scale", lambda w: w.reshape(h, hd), (h * hd,))
        m[p + "self_attn.k_norm.weight"] = ("k_norm/scale", lambda w: w.reshape(kv, hd), (kv * hd,))
    elif config.qk_norm_head_scales:  # Cohere: [heads, head_dim] as transformers stores them
        m[p + "self_attn.q_norm.weight"] = ("q_norm/scale", r, (h, hd))
        m[p + "self_attn.k_norm.weight"] = ("k_norm/scale", r, (kv, hd))
    elif config.qk_norm:
        m[p + "self_attn.q_norm.weight"] = ("q_norm/scale", lambda w: w, (hd,))
        m[p + "self_attn.k_norm.weight"] = ("k_norm/scale", lambda w: w, (hd,))
    if config.mlp_bias:
        m[p + "mlp.gate_proj.bias"] = ("b_gate", lambda b: b, (f,))
        m[p + "mlp.up_proj.bias"] = ("b_up", lambda b: b, (f,))
        m[p + "mlp.down_proj.bias"] = ("b_down", lambda b: b, (d,))
    return {layout_name(config, k): v for k, v in m.items()}


def _rope_permutation(config: ModelConfig, back: bool = False):
    """Index along head_dim taking a checkpoint's interleaved RoPE layout (pairs (2i, 2i + 1) rotate by frequency
    i: Cohere) to the half-split one the forward rotates (i and hd/2 + i): ours[j] = hf[perm[j]]; back: its
    inverse. None where the checkpoint's RoPE is half-split already."""
    if not config.rope_interleaved:
        return None
    hd = config.head_dim
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    return np.argsort(perm) if back else perm


def _to_halves(config: ModelConfig, back: bool = False):
    """x[..., head_dim] -> x in the half-split RoPE layout (back: to the checkpoint's); the identity where they
    agree. Applied to the query / key projections, their biases and norm scales alike, so q . k and the per-head
    norms are unchanged."""
    perm = _rope_permutation(config, back)
    return (lambda x: x) if perm is None else (lambda x: x[..., perm])


# Granite-MoE layouts: experts fused in block_sparse_moe.{input_linear, output_linear}, router.layer
_GRANITE_MOE = ("granitemoe", "granitemoeshared")
# model_type -> (the MoE block's module, its experts' (gate, up, down) projections)
_MOE_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
              "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "phimoe": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _expert_slot(ours: str) -> tuple:
    """"we_gate[3]" -> ("we_gate", 3); "wq" -> ("wq", None)."""
    if ours.endswith("]"):
        name, j = ours[:-1].split("[")
        return name, int(j)
    return ours, None


def _gpt2_prefix(tensors: dict) -> str:
    return "transformer." if any(k.startswith("transformer.") for k in tensors) else ""


def _take_checked(tensors: dict, key: str, shape, used: set):
    """tensors[key], checked to exist with the expected shape, and marked as used."""
    if key not in tensors:
        raise CheckpointError(f"missing weight tensor {key!r} (expected shape {tuple(shape)})")
    w = tensors[key]
    if tuple(w.shape) != tuple(shape):
        raise CheckpointError(f"weight tensor {key!r} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    used.add(key)
    return w


def _convert_gpt2(config: ModelConfig, tensors: dict, expect):
    d, h, hd = config.hidden_size, config.num_heads, config.head_dim
    pre = _gpt2_prefix(tensors)
    used = set()

    def get(name, shape):
        return _take_checked(tensors, pre + name, shape, used)

    f = config.intermediate_size
    layers = {k: [] for k in ("attn_norm/scale", "attn_norm/bias", "mlp_norm/scale", "mlp_norm/bias", "wq",
                              "wk", "wv", "bq", "bk", "bv", "wo", "bo", "w_up", "b_up", "w_down",
                              "b_down")}
    for i in range(config.num_layers):
        p = f"h.{i}."
        layers["attn_norm/scale"].append(get(p + "ln_1.weight", (d,)))
        layers["attn_norm/bias"].append(get(p + "ln_1.bias", (d,)))
        layers["mlp_norm/scale"].append(get(p + "ln_2.weight", (d,)))
        layers["mlp_norm/bias"].append(get(p + "ln_2.bias", (d,)))
        w = get(p + "attn.c_attn.weight", (d, 3 * d))  # Conv1D: [in, out]
        b = get(p + "attn.c_attn.bias", (3 * d,))
        for j, name in enumerate(("q", "k", "v")):
            layers["w" + name].append(w[:, j * d:(j + 1) * d].reshape(d, h, hd))
            layers["b" + name].append(b[j * d:(j + 1) * d].reshape(h, hd))
        layers["wo"].append(get(p + "attn.c_proj.weight", (d, d)).reshape(h, hd, d))
        layers["bo"].append(get(p + "attn.c_proj.bias", (d,)))
        layers["w_up"].append(get(p + "mlp.c_fc.weight", (d, f)))
        layers["b_up"].append(get(p + "mlp.c_fc.bias", (f,)))
        layers["w_down"].append(get(p + "mlp.c_proj.weight", (f, d)))
        layers["b_down"].append(get(p + "mlp.c_proj.bias", (d,)))
    params = {
        "embed": get("wte.weight", (config.vocab_size, d)),
        "pos_embed": get("wpe.weight", (config.max_position_embeddings, d)),
        "final_norm": {"scale": get("ln_f.weight", (d,)), "bias": get("ln_f.bias", (d,))},
        "layers": _nest({k: jnp.stack(v) for k, v in layers.items()}),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = get_head(tensors, config, used)
    used |= {k for k in tensors if k == "lm_head.weight" and config.tie_word_embeddings}
    return params, used


def get_head(tensors, config, used):
    name = layout_name(config, "lm_head.weight")
    if name not in tensors:
        raise CheckpointError(f"missing weight tensor {name!r} (the config says "
                              "tie_word_embeddings=false, so the LM head must be stored)")
    w = tensors[name]
    if tuple(w.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(f"weight tensor {name!r} has shape {tuple(w.shape)}, expected "
                              f"{(config.vocab_size, config.hidden_size)}")
    used.add(name)
    return w.T


def _nest(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        node = out
        parts = k.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def _convert_llama(config: ModelConfig, tensors: dict, expect: dict):
    used = set()
    per_layer: dict[str, list] = {}
    for i in range(config.num_layers):
        experts: dict[str, list] = {}  # a stacked expert weight's slices of this layer, in expert order
        for hf_name, (ours, conv, hf_shape) in _hf_layer_map(config, i).items():
            if hf_name not in tensors:
                raise CheckpointError(f"missing weight tensor {hf_name!r} (expected shape {hf_shape})")
            if tuple(tensors[hf_name].shape) != hf_shape:
                raise CheckpointError(f"weight tensor {hf_name!r} has shape {tuple(tensors[hf_name].shape)}, "
                                      f"expected {hf_shape}")
            if isinstance(ours, tuple):  # a fused tensor: each part to its own parameter
                parts = conv_checked(hf_name, tensors[hf_name], conv,
                                     tuple(_lookup(expect["layers"], path)[1:] for path in ours))
                for path, w in zip(ours, parts):
                    per_layer.setdefault(path, []).append(w)
                used.add(hf_name)
                continue
            path, expert = _expert_slot(ours)
            expected = _lookup(expect["layers"], path)[1 if expert is None else 2:]
            w = conv_checked(hf_name, tensors[hf_name], conv, expected)
            (per_layer if expert is None else experts).setdefault(path, []).append(w)
            used.add(hf_name)
        for path, ws in experts.items():
            per_layer.setdefault(path, []).append(jnp.stack(ws))
    d, v = config.hidden_size, config.vocab_size

    def get(name, shape):
        return _take_checked(tensors, name, shape, used)

    params = {
        "embed": get(layout_name(config, "model.embed_tokens.weight"), (v, d)),
        "final_norm": {"scale": get(layout_name(config, "model.norm.weight"), (d,))},
        "layers": _nest({k: jnp.stack(x) for k, x in per_layer.items()}),
    }
    if config.layer_norm:
        params["final_norm"]["bias"] = get("model.norm.bias", (d,))
    if config.lm_head_bias:  # a bias of its own, also beside a tied head
        params["lm_head_bias"] = get("lm_head.bias", (v,))
    if config.tie_word_embeddings:  # some tied checkpoints store a copy of the embedding as the head
        head = layout_name(config, "lm_head.weight")
        if head in tensors and not np.array_equal(np.asarray(tensors[head]), np.asarray(params["embed"])):
            raise CheckpointError(f"{head!r} is stored but differs from the embedding, while config.json ties "
                                  f"them (tie_word_embeddings / weight_tying = true): fix config.json")
        used.add(head)
    else:
        params["lm_head"] = get_head(tensors, config, used)
    return params, used


def _lookup(tree, path):
    node = tree
    for p in path.split("/"):
        node = node[p]
    return node


def conv_checked(name, w, conv, expected_shape):
    """conv(w), checked to have expected_shape (a tuple of shapes: conv gives that many parts)."""
    try:
        out = conv(w)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"weight tensor {name!r} has shape {tuple(w.shape)}, which does not fit "
                              f"the expected {tuple(expected_shape)} (after transposing): {e}") from None
    fused = isinstance(out, tuple)
    got = tuple(tuple(o.shape) for o in out) if fused else tuple(out.shape)
    want = tuple(tuple(s) for s in expected_shape) if fused else tuple(expected_shape)
    if got != want:
        raise CheckpointError(f"weight tensor {name!r} has shape {tuple(w.shape)}, which does not fit "
                              f"the expected {want}")
    return out


def load_params(path, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Load (config, params) from a Hugging Face checkpoint directory. Of a vision-language checkpoint
    (Gemma 3's Gemma3ForConditionalGeneration) the language model loads, as its text-only layout."""
    path = Path(path)
    cfg = read_config(path)
    layout = cfg.get("model_type")
    if layout in _TEXT_TOWERS:
        cfg = _text_config(cfg, path)
    try:
        config = ModelConfig.from_hf_dict(cfg, dtype=dtype)
    except KeyError as e:
        raise ConfigError(f"{path / 'config.json'} has no {e.args[0]!r}, which a "
                          f"{cfg.get('model_type')} config needs") from None
    except (TypeError, AttributeError) as e:
        raise ConfigError(f"{path / 'config.json'} holds a value of the wrong type "
                          f"({_one_line(e)})") from None
    if config.is_diffusion and config.mask_token_id is None:
        mask_id = tokenizer_mask_id(path)
        if mask_id is not None:
            try:
                config = config.replace(mask_token_id=mask_id)
            except ConfigError as e:
                raise ConfigError(f"the MASK token of the tokenizer in {path}: {e}") from None
    tensors = _read_tensors(path)
    if layout in _TEXT_TOWERS:
        tensors = _text_tensors(tensors, layout)
    expect = param_shapes(config)
    if config.is_gpt2:
        params, used = _convert_gpt2(config, tensors, expect)
    else:
        params, used = _convert_llama(config, tensors, expect)
    unexpected = sorted(k for k in tensors if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise CheckpointError(f"{len(unexpected)} weight tensors in {path} are not used by a "
                              f"{config.model_type} model with this config.json: {shown}")
    dt = config.jnp_dtype
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dt), params)
    got = jax.tree.map(lambda a: tuple(a.shape), params)
    if got != expect:
        raise CheckpointError(f"checkpoint parameters do not match the config: {got} vs {expect}")
    return config, params


def to_hf_tensors(config: ModelConfig, params) -> dict[str, jax.Array]:
    """Our params -> HF tensor names and layouts (inverse of load_params)."""
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    L = params["layers"]
    out = {}
    if config.is_gpt2:
        for i in range(config.num_layers):
            p = f"transformer.h.{i}."
            out[p + "ln_1.weight"] = L["attn_norm"]["scale"][i]
            out[p + "ln_1.bias"] = L["attn_norm"]["bias"][i]
            out[p + "ln_2.weight"] = L["mlp_norm"]["scale"][i]
            out[p + "ln_2.bias"] = L["mlp_norm"]["bias"][i]
            out[p + "attn.c_attn.weight"] = jnp.concatenate(
                [L[w][i].reshape(d, d) for w in ("wq", "wk", "wv")], axis=1)
            out[p + "attn.c_attn.bias"] = jnp.concatenate([L[b][i].reshape(d) for b in ("bq", "bk", "bv")])
            out[p + "attn.c_proj.weight"] = L["wo"][i].reshape(d, d)
            out[p + "attn.c_proj.bias"] = L["bo"][i]
            out[p + "mlp.c_fc.weight"] = L["w_up"][i]
            out[p + "mlp.c_fc.bias"] = L["b_up"][i]
            out[p + "mlp.c_proj.weight"] = L["w_down"][i]
            out[p + "mlp.c_proj.bias"] = L["b_down"][i]
        out["transformer.wte.weight"] = params["embed"]
        out["transformer.wpe.weight"] = params["pos_embed"]
        out["transformer.ln_f.weight"] = params["final_norm"]["scale"]
        out["transformer.ln_f.bias"] = params["final_norm"]["bias"]
    else:
        r = _to_halves(config, back=True)  # our half-split q / k back to the checkpoint's RoPE layout (Cohere)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            if config.post_norms:  # OLMo 2: output norms only
                out[p + "post_attention_layernorm.weight"] = L["attn_out_norm"]["scale"][i]
                out[p + "post_feedforward_layernorm.weight"] = L["mlp_out_norm"]["scale"][i]
            elif config.sandwich_norms:
                out[p + "input_layernorm.weight"] = L["attn_norm"]["scale"][i]
                out[p + "post_attention_layernorm.weight"] = L["attn_out_norm"]["scale"][i]
                out[p + "pre_feedforward_layernorm.weight"] = L["mlp_norm"]["scale"][i]
                out[p + "post_feedforward_layernorm.weight"] = L["mlp_out_norm"]["scale"][i]
            else:
                out[p + "input_layernorm.weight"] = L["attn_norm"]["scale"][i]
                if not config.parallel_block:
                    out[p + "post_attention_layernorm.weight"] = L["mlp_norm"]["scale"][i]
                if config.layer_norm:
                    out[p + "input_layernorm.bias"] = L["attn_norm"]["bias"][i]
                    out[p + "post_attention_layernorm.bias"] = L["mlp_norm"]["bias"][i]
            q, k, v = (r(L["wq"][i]).reshape(d, h * hd).T, r(L["wk"][i]).reshape(d, kv * hd).T,
                       L["wv"][i].reshape(d, kv * hd).T)
            if config.model_type == "phi3":  # fused back as Phi-3 stores them
                out[p + "self_attn.qkv_proj.weight"] = jnp.concatenate([q, k, v], axis=0)
            else:
                out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                            p + "self_attn.v_proj.weight": v})
            out[p + "self_attn.o_proj.weight"] = L["wo"][i].reshape(h * hd, d).T
            if config.model_type == "phi3":
                out[p + "mlp.gate_up_proj.weight"] = jnp.concatenate([L["w_gate"][i].T, L["w_up"][i].T], axis=0)
                out[p + "mlp.down_proj.weight"] = L["w_down"][i].T
            elif config.model_type in _GRANITE_MOE:  # fused again as transformers stores them
                q = p + "block_sparse_moe."
                out[q + "router.layer.weight"] = L["w_router"][i].T
                out[q + "input_linear.weight"] = jnp.concatenate(
                    [L["we_gate"][i].transpose(0, 2, 1), L["we_up"][i].transpose(0, 2, 1)], axis=1)
                out[q + "output_linear.weight"] = L["we_down"][i].transpose(0, 2, 1)
                if config.shared_expert_intermediate_size:
                    out[p + "shared_mlp.input_linear.weight"] = jnp.concatenate([L["ws_gate"][i].T, L["ws_up"][i].T])
                    out[p + "shared_mlp.output_linear.weight"] = L["ws_down"][i].T
            elif config.num_experts:
                moe, (gate, up, down) = _MOE_NAMES[config.model_type]
                out[p + moe + ".gate.weight"] = L["w_router"][i].T
                for j in range(config.num_experts):
                    q = f"{p}{moe}.experts.{j}."
                    out[q + gate + ".weight"] = L["we_gate"][i, j].T
                    out[q + up + ".weight"] = L["we_up"][i, j].T
                    out[q + down + ".weight"] = L["we_down"][i, j].T
                if config.shared_expert_intermediate_size:
                    out[p + "mlp.shared_expert.gate_proj.weight"] = L["ws_gate"][i].T
                    out[p + "mlp.shared_expert.up_proj.weight"] = L["ws_up"][i].T
                    out[p + "mlp.shared_expert.down_proj.weight"] = L["ws_down"][i].T
                    out[p + "mlp.shared_expert_gate.weight"] = L["w_shared_gate"][i].T
            else:
                out[p + "mlp.gate_proj.weight"] = L["w_gate"][i].T
                out[p + "mlp.up_proj.weight"] = L["w_up"][i].T
                out[p + "mlp.down_proj.weight"] = L["w_down"][i].T
            if config.qkv_bias:
                out[p + "self_attn.q_proj.bias"] = r(L["bq"][i]).reshape(-1)
                out[p + "self_attn.k_proj.bias"] = r(L["bk"][i]).reshape(-1)
                out[p + "self_attn.v_proj.bias"] = L["bv"][i].reshape(-1)
            if config.o_bias:
                out[p + "self_attn.o_proj.bias"] = L["bo"][i]
            if config.qk_norm_head_scales:  # Cohere's: [H, hd] as transformers stores them
                out[p + "self_attn.q_norm.weight"] = r(L["q_norm"]["scale"][i])
                out[p + "self_attn.k_norm.weight"] = r(L["k_norm"]["scale"][i])
            elif config.qk_norm:  # OLMo 2's over all heads: flattened back to [H * hd]
                out[p + "self_attn.q_norm.weight"] = L["q_norm"]["scale"][i].reshape(-1)
                out[p + "self_attn.k_norm.weight"] = L["k_norm"]["scale"][i].reshape(-1)
            if config.mlp_bias:
                out[p + "mlp.gate_proj.bias"] = L["b_gate"][i]
                out[p + "mlp.up_proj.bias"] = L["b_up"][i]
                out[p + "mlp.down_proj.bias"] = L["b_down"][i]
        out["model.embed_tokens.weight"] = params["embed"]
        out["model.norm.weight"] = params["final_norm"]["scale"]
        if config.layer_norm:
            out["model.norm.bias"] = params["final_norm"]["bias"]
        if config.lm_head_bias:
            out["lm_head.bias"] = params["lm_head_bias"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    if not config.is_gpt2:
        out = {layout_name(config, k): v for k, v in out.items()}
    return out


def save_params(config: ModelConfig, params, path, *, max_shard_bytes: int | None = None,
                dtype: str | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when larger than max_shard_bytes)."""
    from safetensors.flax import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    dt = config.jnp_dtype
    tensors = {k: jnp.asarray(v, dt) for k, v in to_hf_tensors(config, params).items()}
    # safetensors needs contiguous host buffers; np.asarray of a transposed jax array is fine.
    tensors = {k: jnp.array(np.asarray(v)) for k, v in tensors.items()}
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards: list[dict] = [{}]
        size = 0
        for k in sorted(tensors):
            nbytes = tensors[k].size * tensors[k].dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][k] = tensors[k]
            size += nbytes
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.size * t.dtype.itemsize for t in tensors.values())
        with open(path / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=2)
    with open(path / "config.json", "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2, sort_keys=True)


# MASK tokens of the diffusion LMs' tokenizers: Fast-dLLM v2 "|<MASK>|", LLaDA "<|mdm_mask|>", Dream "<|mask|>".
MASK_TOKENS = ("|<MASK>|", "<|mdm_mask|>", "<|mask|>")


def tokenizer_mask_id(path) -> int | None:
    """The id of a MASK token (MASK_TOKENS) among the added tokens of the tokenizer files in `path`
    (tokenizer.json "added_tokens", tokenizer_config.json "added_tokens_decoder"), or None."""
    path = Path(path)
    found: dict[str, int] = {}
    if (path / "tokenizer.json").exists():
        for t in read_json_object(path / "tokenizer.json").get("added_tokens") or ():
            if isinstance(t, dict) and t.get("content") in MASK_TOKENS and isinstance(t.get("id"), int):
                found.setdefault(t["content"], t["id"])
    if (path / "tokenizer_config.json").exists():
        decoder = read_json_object(path / "tokenizer_config.json").get("added_tokens_decoder") or {}
        for k, t in (decoder.items() if isinstance(decoder, dict) else ()):
            if isinstance(t, dict) and t.get("content") in MASK_TOKENS and str(k).isdigit():
                found.setdefault(t["content"], int(k))
    ids = {found[m] for m in MASK_TOKENS if m in found}
    if len(ids) > 1:
        raise CheckpointError(f"the tokenizer in {path} has several MASK tokens ({found}); set mask_token_id "
                              f"in config.json to the one the model was trained with")
    return ids.pop() if ids else None


# The tokenizer files that are JSON: checked first, so a damaged one is named.
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def _auto_tokenizer():
    """transformers.AutoTokenizer, imported without transformers' "PyTorch was not found" advice: jaxdecode
    uses only its tokenizers, so on a machine without torch the line says nothing that applies. The
    advisory switch is set for the import alone and restored, so the user's own transformers advice is kept."""
    import sys
    if "transformers" in sys.modules:
        from transformers import AutoTokenizer
        return AutoTokenizer
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        from transformers import AutoTokenizer
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    return AutoTokenizer


def load_tokenizer(path):
    """transformers.AutoTokenizer from a local directory, or None if the directory has no tokenizer.

    Tokenizer files that do not load are a CheckpointError naming the directory (and the file when
    it is one of the JSON files).
    """
    path = Path(path)
    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                              "tokenizer.model")):
        return None
    for name in _TOKENIZER_JSON:
        if (path / name).exists():
            read_json_object(path / name)
    AutoTokenizer = _auto_tokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers / tokenizers raise many types, none naming the file
        raise CheckpointError(f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: "
                              f"{_one_line(e)}); fix or replace its tokenizer files, or remove them and "
                              f"pass prompts as token-id lists") from None
