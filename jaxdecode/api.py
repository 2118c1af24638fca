"""The public surface: `load(path)` and `generate(model, prompts, method=..., **options)`.

Methods live in a registry (`jaxdecode.registry`), so every decoder — autoregressive, beam, and the
speculative / diffusion / constrained decoders — is reachable by name from Python and from the CLI
with one code path for tokenising, batching, timing and detokenising.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

import jaxdecode.decoders  # noqa: F401  (registers the built-in methods)
import jaxdecode.constraints.asap  # noqa: F401  (registers asap)
import jaxdecode.diffusion  # noqa: F401  (registers diffusion / block_diffusion)
from jaxdecode.bench import CompileClock
from jaxdecode.decoders import SETUP_KEY
from jaxdecode.model import EMBEDDED_DIR, Model, embedded_model_path, load  # noqa: F401  (public names)
from jaxdecode.genconfig import GenerationConfig  # noqa: F401  (public name)
from jaxdecode.options import OPTIONS, OptionError, per_prompt  # noqa: F401  (public names)
from jaxdecode.registry import get_method, methods, register_method  # noqa: F401
from jaxdecode.sharding import to_host


@dataclasses.dataclass(frozen=True)
class Generation:
    """One output. `tokens` are the new tokens (up to and including an EOS or the token that completed a
    stop string); `text` is their text with special tokens left out (generate(skip_special_tokens=False)
    keeps them) and cut before a stop string. `finish_reason`: "eos", "stop" (a stop string; `stop` names
    it), "length" (max_new_tokens; diffusion: the answer block), "complete" (a constraint's item ended
    without EOS), "unfinished" (diffusion: max_forwards ran out with MASK slots left; never `valid`) or
    "none" (a beam beyond the hypotheses beam search found: no output).

    `stats` are this row's own figures; `batch_stats` are the whole call's (shared by its rows: seconds,
    compile_seconds, target_calls, the speculative drafter / tree, ...). With logprobs=True, `logprobs`
    holds each new token's log-prob under the distribution it was drawn from, and with top_logprobs=n
    `top_logprobs` the n most likely (token id, log-prob) pairs per step; with echo=True
    `prompt_logprobs` the prompt tokens' (None for the first). With num_return_sequences=n a prompt gives
    n Generations in a row (`index` 0..n-1).

    Under regex= / json_schema= / grammar=: `valid` says whether the text (without its EOS) satisfies
    the constraint, checked apart from the automaton by `validator` (re.fullmatch, jsonschema, lark or
    llguidance; valid None: none could read it), and `backend` names what enforced it while decoding."""
    prompt: Any
    text: str
    tokens: list[int]
    stats: dict
    valid: bool | None = None
    constraint: str | None = None  # regex | json_schema | grammar, or None (unconstrained)
    backend: str | None = None
    validator: str | None = None
    batch_stats: dict = dataclasses.field(default_factory=dict)
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that ended the row
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_tokens: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    index: int = 0  # which of the prompt's num_return_sequences

    def to_json(self) -> dict:
        out = {"prompt": self.prompt, "text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
               "stats": self.stats}
        for name in ("stop", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.top_logprobs is not None:
            out["top_logprobs"] = [[list(p) for p in step] for step in self.top_logprobs]
        if self.index:
            out["index"] = self.index
        if self.constraint is not None:
            out.update(valid=self.valid, constraint=self.constraint, backend=self.backend, validator=self.validator)
        return out


# ----------------------------------------------------------------------------- prompts
def _is_conversation(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


def _is_array(p) -> bool:
    return isinstance(p, (np.ndarray, jax.Array))


def _is_ids(p) -> bool:
    """One prompt's token ids: a list of ints, or a 1-D integer array (a 2-D one is a batch of prompts)."""
    if _is_array(p):
        return p.ndim == 1
    return (isinstance(p, Sequence) and not isinstance(p, str) and bool(p) and
            all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p))


def _check_id_array(p, what: str):
    """An array of token ids must hold integers: a float array would be truncated to ids silently."""
    if not (np.issubdtype(p.dtype, np.integer) and p.dtype != np.bool_):
        raise ValueError(f"{what} is an array of {p.dtype}: token ids must be integers (cast with "
                         f".astype(np.int32) if the values are ids)")
    if p.ndim not in (1, 2):
        raise ValueError(f"{what} is a {p.ndim}-D array of shape {p.shape}: pass one prompt's ids as a 1-D "
                         f"array, or a batch of equal-length prompts as a 2-D array [batch, length]")


def _prompt_list(prompts, messages) -> list:
    """The prompts as a list of items, each a text, a token-id list or a conversation."""
    if messages is not None:
        if prompts is not None:
            raise ValueError("give prompts or messages=, not both (a conversation can also be an item of prompts)")
        if _is_conversation(messages):
            return [list(messages)]
        if isinstance(messages, Sequence) and messages and all(_is_conversation(c) for c in messages):
            return [list(c) for c in messages]
        raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                         "dicts) or a list of conversations")
    if prompts is None:
        raise ValueError("give prompts (a string, token ids, or a list of them) or messages=[{'role': 'user', "
                         "'content': ...}]")
    if _is_array(prompts):
        _check_id_array(prompts, "prompts")
        return [prompts] if prompts.ndim == 1 else list(np.asarray(prompts))  # 2-D: one prompt per row
    if isinstance(prompts, str) or _is_ids(prompts) or _is_conversation(prompts):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, dict)) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of token ids, a conversation, or a non-empty list of "
                         "them")
    return list(prompts)


# apply_chat_template arguments jaxdecode sets itself (the turn is opened, text comes back)
_TEMPLATE_OWN = ("conversation", "messages", "add_generation_prompt", "tokenize", "continue_final_message",
                 "return_dict")


def check_chat_template_kwargs(kwargs) -> dict:
    """chat_template_kwargs as a dict of variables for the template, or a ValueError saying what is wrong."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables by name, e.g. "
                         f"{{'enable_thinking': False}}, got {kwargs!r:.80}")
    own = sorted(set(kwargs) & set(_TEMPLATE_OWN))
    if own:
        raise ValueError(f"chat_template_kwargs sets {own}, which jaxdecode sets itself (the assistant's turn "
                         f"opened, text returned); leave them out")
    return dict(kwargs)


def apply_chat_template(model: Model, conversation, chat_template_kwargs: dict | None = None) -> str:
    """The conversation as the tokenizer's chat template writes it, with the assistant's turn opened
    (transformers' apply_chat_template(..., add_generation_prompt=True)). chat_template_kwargs: the
    template's own variables, e.g. {"enable_thinking": False} (Qwen3) or {"tools": [...]}."""
    return _format_conversation(model, conversation, check_chat_template_kwargs(chat_template_kwargs))


def _format_conversation(model: Model, conversation, template_vars: dict) -> str:
    """apply_chat_template with its template variables already checked."""
    for i, m in enumerate(conversation):
        if not (isinstance(m.get("role"), str) and "content" in m):
            raise ValueError(f"message {i} of the conversation is {m!r}: each message needs a 'role' (a string) "
                             f"and a 'content'")
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"model {model.path} has no tokenizer, so no chat template: pass token ids instead")
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer of {model.path} has no chat template (no 'chat_template' in "
                         f"tokenizer_config.json, no chat_template.jinja), so messages cannot be formatted; "
                         f"pass the prompt as text (formatted yourself), or set model.tokenizer.chat_template")
    return tok.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=False, **template_vars)


def _tokenize(model: Model, items: list, add_special_tokens: bool | None, template_vars: dict) -> list[list[int]]:
    """Token ids of each item: texts as the tokenizer encodes them (its own special tokens, e.g. a BOS,
    unless add_special_tokens=False), conversations through the chat template (which writes its own
    special tokens, so none are added: transformers' rule), token ids as given."""
    token_lists = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            ids = model.encode(p, add_special_tokens=True if add_special_tokens is None else add_special_tokens)
        elif _is_conversation(p):
            ids = model.encode(_format_conversation(model, p, template_vars),
                               add_special_tokens=bool(add_special_tokens))
        elif _is_ids(p):
            if _is_array(p):
                _check_id_array(p, f"prompt {i}")
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is {type(p).__name__} {p!r:.80}: each prompt must be a string, a list of "
                             f"token ids or a conversation (a list of {{'role', 'content'}} dicts)")
        if not ids:
            raise ValueError(f"prompt {i} is empty (it encodes to no tokens); every prompt needs at "
                             f"least one token")
        token_lists.append(ids)
    return token_lists


class NonFiniteLogitsError(ValueError):
    """The model's logits were NaN or infinite while rows were decoding: their output is garbage."""

    def __init__(self, message: str, results: list):
        super().__init__(message)
        self.results = results  # the Generations, each with stats["nonfinite_logits"]


NONFINITE_STAT = "nonfinite_logits"  # per-row stat of every built-in method
_LOGPROB_STATS = ("logprobs", "top_logprobs", "top_logprob_ids")  # per-token outputs, not figures
_BEAMS = ("beam", "diverse_beam", "constrained_beam")


# ----------------------------------------------------------------------------- generate
def generate(model: Model, prompts=None, method: str | None = None, max_new_tokens: int | None = None, *,
             messages=None, chat_template_kwargs: dict | None = None,
             generation_config: GenerationConfig | None = None,
             num_return_sequences: int | None = None, add_special_tokens: bool | None = None,
             skip_special_tokens: bool = True, echo: bool = False, temperature: float | None = None,
             seed: int | None = None, eos_ids: Sequence[int] | None = None, _stream=None,
             **options) -> list[Generation]:
    """Generate continuations of `prompts`: a string, token ids, a conversation, or a list of them; or
    `messages=` (a conversation, [{"role": "user", "content": ...}, ...], or a list of them), formatted
    by the tokenizer's chat template with the assistant's turn opened; `chat_template_kwargs` are the
    template's own variables (e.g. {"enable_thinking": False} for Qwen3, {"tools": [...]}).

    As transformers does: texts are encoded with the tokenizer's special tokens (a BOS where it adds one;
    add_special_tokens=False: none), token ids are used as given, and the returned text leaves special
    tokens out (skip_special_tokens=False keeps them). Defaults come from `generation_config` (a
    jaxdecode.GenerationConfig) over the checkpoint's generation_config.json (`model.generation_config`):
    EOS ids, max_new_tokens, the method (do_sample / num_beams), temperature, top-k/p, repetition
    penalty, stop strings; explicit arguments win (jaxdecode.genconfig). `num_return_sequences=n` gives
    n outputs per prompt (sampling methods: n independent draws; beam methods: the n best beams).

    `method` is any registered name (`jaxdecode.methods()`): greedy, sample, mirostat, beam,
    diverse_beam, and the speculative/constrained decoders. stop=["\n\n", ...] ends each row once its
    text contains a stop string (a token automaton inside the loop). logprobs=True / top_logprobs=n add
    the target's per-token log-probs; echo=True the prompt's. Structured output: regex=, json_schema= or
    grammar= (one value, or a list with one per prompt) constrains the methods in
    jaxdecode.options.STRUCTURED; each Generation then says whether its text is `valid`. Options are the
    method's own; every option, what it accepts and its default are in `jaxdecode.options.OPTIONS`
    (README, "Options"). All are checked before anything decodes; None means "unset".

    Returns one `Generation` per output, with per-row stats (new_tokens, nonfinite_logits, the method's
    own per-row figures) and batch_stats shared by the call: seconds (the decode's wall time without
    compilation), compile_seconds (the decode's JAX tracing + compiling: ~0 on a repeated call at the
    same shapes; None when this JAX cannot report it, then seconds includes it), target_calls, and the
    method's batch-wide figures (speculative: calibrate_seconds, tree_auto_seconds and
    drafter_load_seconds, the time spent measuring step costs, choosing tree="auto" and loading the
    drafter (a draft model, a trained drafter's weights, a datastore's table; ~0 once loaded in the
    process) with their compiles, left out of seconds and compile_seconds; under a structured option
    also constraint_backend and constraint_compile_seconds: host compile time, not in seconds).

    If the model's logits were NaN/inf at a step where a row was decoding, raises
    NonFiniteLogitsError naming the rows (its `.results` holds the outputs) unless
    allow_nonfinite=True.
    """
    from jaxdecode.autoregressive import pad_prompts
    from jaxdecode.options import resolve
    from jaxdecode.structured import build_constraint, structured_request
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        if not callable(getattr(generation_config, "to_diff_dict", None)):
            raise TypeError(f"generation_config must be a jaxdecode.GenerationConfig (or a "
                            f"transformers.GenerationConfig), got {type(generation_config).__name__}")
        generation_config = GenerationConfig.from_transformers(generation_config)
    defaults = generation_config.over(model.generation_config) if generation_config is not None \
        else model.generation_config
    spec = get_method(method if method is not None else (defaults.method() if defaults else "greedy"))
    _check_model_kind(model, spec.name)
    if echo and getattr(model.config, "is_diffusion", False):
        raise ValueError("echo=True reports the prompt's left-to-right log-probs, which a masked-diffusion LM "
                         "does not define; drop echo")
    items = _prompt_list(prompts, messages)
    template_vars = check_chat_template_kwargs(chat_template_kwargs)
    if template_vars and not any(_is_conversation(p) for p in items):
        raise ValueError("chat_template_kwargs are the chat template's variables, but no prompt is a conversation "
                         "(messages= or a list of {'role', 'content'} dicts; CLI --chat): pass one, or drop them")
    token_lists = _tokenize(model, items, add_special_tokens, template_vars)
    given = dict(options, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_ids=eos_ids)
    if defaults is not None:  # the checkpoint's / caller's generation config fills what the call leaves unset
        from jaxdecode.options import common_options
        takes = set(common_options()) | set(spec.options)
        for k, v in defaults.options_for(spec.name, takes).items():
            if given.get(k) is None:
                given[k] = v
        ignored = defaults.ignored_by(spec.name, takes)
        if ignored:
            import warnings
            warnings.warn(f"the generation config sets {', '.join(ignored)}, which method {spec.name!r} does not "
                          f"apply, so its output differs from transformers.generate with that config; use a "
                          f"method that takes them where one does, or pass a generation_config without them "
                          f"to silence this",
                          UserWarning, stacklevel=2)
    n_seq = num_return_sequences if num_return_sequences is not None else (
        defaults.num_return_sequences if defaults is not None and defaults.num_return_sequences else 1)
    beams = spec.name in _BEAMS
    repeat = _check_num_return_sequences(n_seq, spec.name, given)
    if repeat > 1:  # sampling: each prompt (and its per-prompt options) n times in a row
        token_lists = [ids for ids in token_lists for _ in range(repeat)]
        for k in ("regex", "json_schema", "grammar", "set_ids"):
            v = given.get(k)
            if v is not None and per_prompt(v) and not isinstance(v, (int, np.integer)) and len(v) == len(items):
                given[k] = [x for x in v for _ in range(repeat)]
    opts = resolve(spec.name, given, batch=len(token_lists))
    from jaxdecode.sharding import check_same_options, mesh_context
    check_same_options(opts, opts.get("mesh"))
    prompt_tokens, prompt_lengths = pad_prompts(token_lists)
    if opts["eos_ids"] is None:
        opts["eos_ids"] = model.config.eos_token_ids
    opts["eos_ids"] = tuple(int(e) for e in opts["eos_ids"])  # validated ints: exact
    if beams and n_seq > opts["num_beams"]:
        raise OptionError(f"num_return_sequences={n_seq} is more than num_beams={opts['num_beams']}: beam search "
                          f"returns its best beams; raise num_beams")
    structured = structured_request(opts, len(token_lists))
    batch_stats = {}
    if structured is not None:  # compiled here, before decoding and outside its timing (the disk cache helps)
        start = time.perf_counter()
        opts["constraint"], constraint_stats = build_constraint(model, structured, opts["eos_ids"])
        batch_stats.update(constraint_stats, constraint_compile_seconds=round(time.perf_counter() - start, 4))
    stops = _stop_list(opts.get("stop"))
    if stops:
        from jaxdecode.stop import stop_constraint
        opts["constraint"] = stop_constraint(model, stops, inner=opts.get("constraint"), eos_ids=opts["eos_ids"])
    if _stream is not None:
        opts["stream"] = _stream
    from_config = max_new_tokens is None and defaults is not None and defaults.max_new_tokens is not None
    max_new_tokens = opts.pop("max_new_tokens")
    allow_nonfinite = opts.pop("allow_nonfinite")
    limit = getattr(model.config, "max_position_embeddings", None)
    if from_config and limit is not None and max(map(len, token_lists)) + max_new_tokens > limit:
        from jaxdecode.autoregressive import PromptError
        raise PromptError(f"max_new_tokens={max_new_tokens}, which the generation config sets (the checkpoint's "
                          f"generation_config.json or generation_config=), + the longest prompt "
                          f"({max(map(len, token_lists))} tokens) exceeds the model's max_position_embeddings "
                          f"({limit}); pass max_new_tokens= (CLI --max-new-tokens) to override it")
    # seconds = the call's wall time minus JAX's tracing / lowering / compiling, reported apart as
    # compile_seconds (None when this JAX cannot report it: then seconds includes it), and minus what
    # the method spent preparing (speculative: calibrate_seconds, tree_auto_seconds,
    # drafter_load_seconds), which its own stats report with its compiles: counted there only, so
    # seconds is the decode's and the figures add up.
    with CompileClock() as compiling, mesh_context(opts.get("mesh")):
        start = time.perf_counter()
        tokens, lengths, stats = spec.run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts)
        tokens, lengths, stats = to_host((tokens, lengths, stats))  # also gathers what spans processes
        wall = time.perf_counter() - start
    setup_wall, setup_compile = opts.pop(SETUP_KEY, (0.0, 0.0))
    compile_seconds = None if compiling.seconds is None else max(compiling.seconds - setup_compile, 0.0)
    seconds = max(wall - setup_wall - (compile_seconds or 0.0), 0.0)
    batch_stats.update(seconds=round(seconds, 4),
                       compile_seconds=None if compile_seconds is None else round(compile_seconds, 4),
                       batch_size=len(token_lists), method=spec.name)
    per_row = set(spec.per_row_stats) | {NONFINITE_STAT}
    for k, v in stats.items():
        if k not in per_row and k not in _LOGPROB_STATS:
            batch_stats[k] = v if isinstance(v, str) else _jsonable(v)
    prompt_lp = None
    if echo:
        from jaxdecode.scoring import prompt_logprobs
        with mesh_context(opts.get("mesh")):
            prompt_lp = prompt_logprobs(model, token_lists, mesh=opts.get("mesh"))
    out = []
    for b, item in enumerate(items if repeat == 1 else [x for x in items for _ in range(repeat)]):
        rows = [(None, int(lengths[b]), np.asarray(tokens[b]))]
        if beams and n_seq > 1:  # the n best beams (beam search keeps them best first)
            rows = [(j, int(np.asarray(stats["beam_lengths"])[b, j]), np.asarray(stats["beams"])[b, j])
                    for j in range(n_seq)]
        for j, length, row_tokens in rows:
            out.append(_result(model, item, b, j if j is not None else (b % repeat), row_tokens[:length], stats,
                               per_row, batch_stats, opts, max_new_tokens, stops, skip_special_tokens,
                               structured, token_lists[b], None if prompt_lp is None else prompt_lp[b],
                               beam=j))
    bad = [b for b, r in enumerate(out) if r.stats.get(NONFINITE_STAT)]
    if bad and not allow_nonfinite:
        dtype = model.config.dtype
        cause = ("NaN/inf weights in the checkpoint, or activations overflowing float32" if dtype == "float32"
                 else f"NaN/inf weights in the checkpoint, or overflow in {dtype} (try "
                      f"jaxdecode.load(..., dtype='float32'), CLI --dtype float32)")
        raise NonFiniteLogitsError(
            f"the model's logits were NaN or infinite while decoding prompt(s) {bad} (of {len(out)}), so "
            f"their output is garbage. Likely cause: {cause}. Pass allow_nonfinite=True (CLI: "
            f"--allow-nonfinite) to get the outputs anyway.", out)
    return out


def _check_num_return_sequences(n, method: str, given: dict) -> int:
    """How many times each prompt is decoded (1 for beams: they return their n best)."""
    if not (isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1):
        raise OptionError(f"num_return_sequences={n!r} is not accepted: give an int >= 1")
    if n == 1 or method in _BEAMS:
        return 1
    samples = method in ("sample", "mirostat", "constrained_sample", "asap") or (
        method == "speculative" and (given.get("temperature") or 0) > 0)
    if not samples:
        raise OptionError(f"num_return_sequences={n} with method {method!r}: greedy decoding gives the same "
                          f"sequence every time; sample (method='sample', or temperature > 0 with "
                          f"'speculative') or use beam search (method='beam', num_beams >= {n})")
    return int(n)


def _stop_list(stop) -> tuple:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _result(model, item, b, index, new, stats, per_row, batch_stats, opts, max_new_tokens, stops,
            skip_special_tokens, structured, prompt_ids, prompt_lp, beam=None) -> Generation:
    """The Generation of output row b (beam j of it when `beam` is given)."""
    from jaxdecode.stop import text_before_stop, trim_at_stop
    from jaxdecode.structured import output_text, validate_text
    new = [int(t) for t in new]
    row_stats = {"new_tokens": len(new)}
    for k, v in stats.items():
        if k in per_row and not (beam is not None and k == "beams"):
            v = np.asarray(v)[b]
            if beam is not None and k in _PER_BEAM:  # this beam's own figure, as its tokens are
                v = v[beam]
            row_stats[k] = _jsonable(v)
    eos = opts["eos_ids"]
    if stops:
        text, hit = text_before_stop(model.decode, new, stops, skip_special_tokens)
    else:
        text, hit = model.decode(new, skip_special_tokens=skip_special_tokens), None
    # A diffusion row returns its answer block: answer_length slots (<= max_new_tokens) at most.
    limit = min(max_new_tokens, opts.get("answer_length") or max_new_tokens)
    if _no_hypothesis(stats, b, beam):
        reason = "none"  # beam search found fewer hypotheses than the beams returned: this one is no output
    elif row_stats.get("unfinished"):
        reason = "unfinished"  # diffusion: max_forwards ran out while answer slots still hold the MASK id
    elif hit is not None:
        reason = "stop"
    elif new and new[-1] in eos:
        reason = "eos"
    elif len(new) >= limit:
        reason = "length"
    else:
        reason = "complete"
    lp = top = None
    if "logprobs" in stats and beam is None:
        lp = [float(x) for x in np.asarray(stats["logprobs"])[b][:len(new)]]
        if "top_logprobs" in stats:
            ids, vals = np.asarray(stats["top_logprob_ids"])[b], np.asarray(stats["top_logprobs"])[b]
            top = [[(int(i), float(v)) for i, v in zip(ids[t], vals[t]) if i >= 0] for t in range(len(new))]
    checked = {}
    if structured is not None:
        exact = output_text(model, new, eos)
        if hit is not None and exact is not None:  # judge the text returned: the part before the stop string
            exact = trim_at_stop(exact, stops)[0]
        valid, validator = validate_text(structured, b, exact, tokens=new, model=model)
        if reason in ("none", "unfinished"):  # no output / not what the model finished: never a valid text
            valid = False
        checked = dict(valid=valid, constraint=structured.kind, validator=validator,
                       backend=batch_stats.get("constraint_backend"))
    prompt = item if isinstance(item, str) or _is_conversation(item) else [int(t) for t in item]
    return Generation(prompt=prompt, text=text, tokens=new, stats=row_stats, batch_stats=batch_stats,
                      finish_reason=reason, stop=hit, logprobs=lp, top_logprobs=top, prompt_tokens=list(prompt_ids),
                      prompt_logprobs=prompt_lp, index=index, **checked)


_PER_BEAM = ("beam_scores", "beam_lengths", "beam_valid")  # per-row stats with one entry per beam


def _no_hypothesis(stats: dict, b: int, beam) -> bool:
    """Whether the returned beam (`beam`, or the best one) of row b holds no hypothesis: beam search found
    fewer than it returns (score -inf; constrained_beam: beam_valid False)."""
    j = 0 if beam is None else beam
    if "beam_valid" in stats:
        return not bool(np.asarray(stats["beam_valid"])[b, j])
    if "beam_scores" in stats:
        score = np.asarray(stats["beam_scores"])
        return score.ndim == 2 and bool(np.isneginf(score[b, j]))
    return False


def _check_model_kind(model: Model, method: str) -> None:
    """A masked-diffusion checkpoint decodes only with the diffusion methods, and they only decode it."""
    from jaxdecode.diffusion import DIFFUSION_METHODS
    diffusion = bool(getattr(model.config, "is_diffusion", False))
    if diffusion and method not in DIFFUSION_METHODS:
        raise ValueError(f"this checkpoint is a masked-diffusion LM (attention={model.config.attention!r}): "
                         f"method {method!r} decodes causal LMs token by token; use method='diffusion'"
                         + (" or 'block_diffusion'" if model.config.attention == "block" else ""))
    if not diffusion and method in DIFFUSION_METHODS:
        raise ValueError(f"method {method!r} decodes masked-diffusion LMs, but this checkpoint is a causal LM; "
                         f"use method='greedy', 'sample' or 'speculative'")


def _jsonable(v):
    v = np.asarray(v)
    if v.ndim == 0:
        return v.item()
    return v.tolist()
