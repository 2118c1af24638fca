"""Synthetic tasks with known dependence structure for diffusion LMs (ParallelBench-style).

    task = make_task("sort", length=6, num_values=6)
    prompts, answers = task.sample(np.random.default_rng(0), 32)   # int32[B, P], int32[B, A]
    task.validate(prompts[0], answers[0])                           # True
    task.expected(prompts[0])                                       # the answer (deterministic tasks)

Deterministic tasks (one correct answer): copy, sort, reverse, addition. Many-answer tasks:
permutation (any ordering of the prompt's set), latin_square (any k x k grid whose rows and columns
are each an ordering of the prompt's k symbols). In a many-answer task every answer position is
uncertain on its own (the marginals are near uniform) but the positions are tightly coupled, so a
decoder that commits several positions from their marginals in one step (fixed top-k, no dependence
awareness) writes duplicates, while one token per step stays valid.

All tasks share one small vocabulary (`TaskVocab`): EOS, SEP, PLUS, MASK, one tag per task (the
prompt's first token says which task it is, so one model can learn several) and `num_values` value
tokens. A prompt is [TAG, body..., SEP]; an answer is exactly `answer_length` value tokens (no EOS).
Training data draws a uniformly random valid answer for many-answer tasks.

Everything here is NumPy (evaluation runs at decode time; nothing imports jaxdecode.training).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

import numpy as np

EOS, SEP, PLUS, MASK = 0, 1, 2, 3
TASK_NAMES = ("copy", "sort", "reverse", "addition", "permutation", "latin_square")
FIRST_VALUE = 4 + len(TASK_NAMES)


class TaskError(ValueError):
    """A task built with parameters it cannot use, or a malformed prompt."""


@dataclasses.dataclass(frozen=True)
class TaskVocab:
    """The token ids of every task: 0 EOS, 1 SEP, 2 PLUS, 3 MASK, 4.. task tags, then the values."""
    num_values: int = 6

    @property
    def size(self) -> int:
        return FIRST_VALUE + self.num_values

    @property
    def mask_id(self) -> int:
        return MASK

    @property
    def eos_id(self) -> int:
        return EOS

    def tag(self, name: str) -> int:
        return 4 + TASK_NAMES.index(name)

    def token_strings(self) -> list[str]:
        """One printable string per id (for a word-level tokenizer and for messages)."""
        return (["<eos>", "<sep>", "+", "<mask>"] + [f"<{n}>" for n in TASK_NAMES]
                + [f"v{i}" for i in range(self.num_values)])

    def decode(self, ids) -> str:
        names = self.token_strings()
        return " ".join(names[int(i)] if 0 <= int(i) < len(names) else f"?{int(i)}" for i in ids)


@dataclasses.dataclass(frozen=True)
class Task:
    """A task over `length` items (latin_square: the order k) and `num_values` value tokens."""
    name: ClassVar[str] = ""
    deterministic: ClassVar[bool] = True
    length: int = 6
    num_values: int = 6

    def __post_init__(self):
        if self.length < 1:
            raise TaskError(f"{self.name}: length must be >= 1, got {self.length}")
        if self.num_values < 2:
            raise TaskError(f"{self.name}: num_values must be >= 2, got {self.num_values}")

    def need_distinct(self, what: str) -> None:
        """Tasks whose prompt holds `length` distinct values need length <= num_values."""
        if self.length > self.num_values:
            raise TaskError(f"{self.name} needs {what} <= num_values (distinct values), got "
                            f"length={self.length}, num_values={self.num_values}")

    # ------------------------------------------------------------------ what each task defines
    @property
    def body_length(self) -> int:
        return self.length

    @property
    def answer_length(self) -> int:
        return self.length

    def sample_body(self, rng: np.random.Generator) -> np.ndarray:
        """A prompt body as values (0 .. num_values-1)."""
        return rng.integers(0, self.num_values, self.length)

    def sample_answer(self, rng: np.random.Generator, body: np.ndarray) -> np.ndarray:
        """A valid answer (values) to `body`: the answer, or a uniformly random one."""
        return self.solve(body)

    def solve(self, body: np.ndarray) -> np.ndarray | None:
        """The one answer (values) of a deterministic task; None for many-answer tasks."""
        return None

    def accepts(self, body: np.ndarray, answer: np.ndarray) -> bool:
        """Is `answer` (values, the right length) a correct answer to `body`?"""
        return bool(np.array_equal(answer, self.solve(body)))

    def check_body(self, body: np.ndarray) -> str | None:
        """Why `body` is not a prompt of this task (None: it is)."""
        return None

    # ------------------------------------------------------------------ shared
    @property
    def options(self) -> dict:
        """The task's own fields (beyond length and num_values) that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("length", "num_values") and getattr(self, f.name) != f.default}

    @property
    def vocab(self) -> TaskVocab:
        return TaskVocab(self.num_values)

    @property
    def prompt_length(self) -> int:
        return self.body_length + 2

    def _prompt(self, body_tokens: np.ndarray) -> np.ndarray:
        return np.concatenate([[self.vocab.tag(self.name)], body_tokens, [SEP]]).astype(np.int32)

    def encode_body(self, body: np.ndarray) -> np.ndarray:
        """Prompt tokens [TAG, body..., SEP] of a body of values."""
        return self._prompt(np.asarray(body) + FIRST_VALUE)

    def parse_prompt(self, prompt) -> np.ndarray:
        """The body (values) of a prompt; a TaskError says what is wrong with a malformed one."""
        p = np.asarray(prompt).reshape(-1)
        if p.shape[0] != self.prompt_length:
            raise TaskError(f"{self.name} prompt must have {self.prompt_length} tokens, got {p.shape[0]}")
        if p[0] != self.vocab.tag(self.name) or p[-1] != SEP:
            raise TaskError(f"not a {self.name} prompt (expected [<{self.name}>, ..., <sep>]): "
                            f"{self.vocab.decode(p)}")
        body = self._parse_body_tokens(p[1:-1])
        why = self.check_body(body)
        if why is not None:
            raise TaskError(f"malformed {self.name} prompt ({why}): {self.vocab.decode(p)}")
        return body

    def _parse_body_tokens(self, tokens: np.ndarray) -> np.ndarray:
        vals = tokens.astype(np.int64) - FIRST_VALUE
        if np.any(vals < 0) or np.any(vals >= self.num_values):
            raise TaskError(f"{self.name} prompt body holds non-value tokens: {self.vocab.decode(tokens)}")
        return vals

    def sample(self, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompts int32[batch, prompt_length], answers int32[batch, answer_length]) as token ids."""
        prompts, answers = [], []
        for _ in range(batch):
            body = self.sample_body(rng)
            prompts.append(self.encode_body(body))
            answers.append(np.asarray(self.sample_answer(rng, body)) + FIRST_VALUE)
        return np.stack(prompts).astype(np.int32), np.stack(answers).astype(np.int32)

    def expected(self, prompt) -> np.ndarray | None:
        """The answer tokens of a deterministic task's prompt; None for many-answer tasks."""
        sol = self.solve(self.parse_prompt(prompt))
        return None if sol is None else (np.asarray(sol) + FIRST_VALUE).astype(np.int32)

    def validate(self, prompt, answer) -> bool:
        """True when `answer` (token ids; trailing EOS tokens are ignored) correctly answers `prompt`.

        A malformed prompt raises a TaskError; a wrong, short, long or non-value answer is False.
        """
        body = self.parse_prompt(prompt)
        a = strip_eos(answer).astype(np.int64) - FIRST_VALUE
        if a.shape[0] != self.answer_length or np.any(a < 0) or np.any(a >= self.num_values):
            return False
        return self.accepts(body, a)


# ----------------------------------------------------------------------------- deterministic tasks
@dataclasses.dataclass(frozen=True)
class CopyTask(Task):
    name: ClassVar[str] = "copy"

    def solve(self, body):
        return np.asarray(body)


@dataclasses.dataclass(frozen=True)
class SortTask(Task):
    name: ClassVar[str] = "sort"

    def solve(self, body):
        return np.sort(body)


@dataclasses.dataclass(frozen=True)
class ReverseTask(Task):
    name: ClassVar[str] = "reverse"

    def solve(self, body):
        return np.asarray(body)[::-1]


DIGIT_ORDERS = ("msd", "lsd")
OPERAND_SIZES = ("full", "mixed")


@dataclasses.dataclass(frozen=True)
class AdditionTask(Task):
    """Two `length`-digit numbers in base `num_values`; the answer is their sum in `length + 1` digits
    (leading zeros kept). Prompt: [TAG, a..., PLUS, b..., SEP].

    digit_order: "msd" writes the operands and the sum most significant digit first (as people write
    them; a sum digit depends on the carries of every digit after it); "lsd" writes all three least
    significant digit first (the usual remedy for left-to-right models). The same numbers, only the
    positions change.
    operand_sizes: "full" draws every digit uniformly; "mixed" (a training curriculum: its prompts are
    prompts of the same task) gives each operand, with probability 1/2, a uniform number 1..length of
    significant digits instead, zero-padded. A short operand makes most sum digits copies of the other
    operand's digits, which teaches the model where the two digits of one significance sit; with
    full-size operands alone a sum digit, (a + b + carry) mod base, is independent of either operand
    digit on its own, so that alignment gets next to no gradient (the 2-layer task model stayed at
    chance on 16-digit sums).
    """
    name: ClassVar[str] = "addition"
    digit_order: str = "msd"
    operand_sizes: str = "full"

    def __post_init__(self):
        super().__post_init__()
        if self.digit_order not in DIGIT_ORDERS:
            raise TaskError(f"addition digit_order must be one of {DIGIT_ORDERS}, got {self.digit_order!r}")
        if self.operand_sizes not in OPERAND_SIZES:
            raise TaskError(f"addition operand_sizes must be one of {OPERAND_SIZES}, got {self.operand_sizes!r}")

    @property
    def body_length(self):
        return 2 * self.length + 1

    @property
    def answer_length(self):
        return self.length + 1

    def sample_body(self, rng):
        digits = rng.integers(0, self.num_values, (2, self.length))  # most significant first
        if self.operand_sizes == "mixed":  # keep the last `size` digits of each operand
            sizes = np.where(rng.random((2, 1)) < 0.5, self.length, rng.integers(1, self.length + 1, (2, 1)))
            digits = np.where(np.arange(self.length) >= self.length - sizes, digits, 0)
        return self._ordered(digits).reshape(-1)

    def _ordered(self, msd_first: np.ndarray) -> np.ndarray:
        """Digits (most significant first, on the last axis) in this task's digit order (its own inverse)."""
        return msd_first[..., ::-1] if self.digit_order == "lsd" else msd_first

    def encode_body(self, body):
        body = np.asarray(body)
        a, b = body[: self.length], body[self.length:]
        return self._prompt(np.concatenate([a + FIRST_VALUE, [PLUS], b + FIRST_VALUE]))

    def _parse_body_tokens(self, tokens):
        if tokens[self.length] != PLUS:
            raise TaskError(f"addition prompt needs '+' after {self.length} digits: {self.vocab.decode(tokens)}")
        return super()._parse_body_tokens(np.concatenate([tokens[: self.length], tokens[self.length + 1:]]))

    def solve(self, body):
        base, n = self.num_values, self.length
        a, b = self._ordered(np.asarray(body).reshape(2, n))
        weights = base ** np.arange(n - 1, -1, -1, dtype=object)
        total = int(np.dot(a.astype(object), weights) + np.dot(b.astype(object), weights))
        digits = [(total // base ** i) % base for i in range(n, -1, -1)]
        return self._ordered(np.asarray(digits, np.int64))


# ----------------------------------------------------------------------------- many-answer tasks
@dataclasses.dataclass(frozen=True)
class PermutationTask(Task):
    """Prompt: `length` distinct values in increasing order; answer: any ordering of them."""
    name: ClassVar[str] = "permutation"
    deterministic: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        self.need_distinct("length")

    def sample_body(self, rng):
        return np.sort(rng.choice(self.num_values, self.length, replace=False))

    def check_body(self, body):
        if np.any(np.diff(body) <= 0):
            return "the values must be distinct and increasing"
        return None

    def sample_answer(self, rng, body):
        return rng.permutation(body)

    def accepts(self, body, answer):
        return bool(np.array_equal(np.sort(answer), np.sort(body)))


@dataclasses.dataclass(frozen=True)
class LatinSquareTask(Task):
    """Prompt: k = `length` distinct symbols in increasing order; answer: a k x k grid, row-major,
    whose every row and column is an ordering of them (any Latin square over those symbols)."""
    name: ClassVar[str] = "latin_square"
    deterministic: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        self.need_distinct("length (the order k)")
        if self.length > 6:
            raise TaskError(f"latin_square supports orders k <= 6 (answers of k*k tokens), got {self.length}")

    @property
    def answer_length(self):
        return self.length * self.length

    def sample_body(self, rng):
        return np.sort(rng.choice(self.num_values, self.length, replace=False))

    check_body = PermutationTask.check_body

    def sample_answer(self, rng, body):
        """Uniform over all Latin squares of order k <= 4 (listed once); for k = 5, 6 a random
        row/column/symbol shuffle of a random reduced-form search result (not exactly uniform)."""
        k = self.length
        squares = _latin_squares(k) if k <= 4 else None
        if squares is not None:
            grid = squares[rng.integers(len(squares))]
        else:
            grid = _random_latin_square(rng, k)
            grid = grid[rng.permutation(k)][:, rng.permutation(k)]
        return np.asarray(body)[grid].reshape(-1)

    def accepts(self, body, answer):
        k = self.length
        grid = np.asarray(answer).reshape(k, k)
        want = np.sort(body)
        return all(np.array_equal(np.sort(grid[i]), want) and np.array_equal(np.sort(grid[:, i]), want)
                   for i in range(k))


_SQUARES: dict[int, np.ndarray] = {}


def _latin_squares(k: int) -> np.ndarray:
    """Every Latin square of order k over 0..k-1: int[n, k, k] (k <= 4: at most 576)."""
    if k not in _SQUARES:
        rows = list(itertools.permutations(range(k)))
        found = []

        def extend(grid):
            if len(grid) == k:
                found.append(grid)
                return
            for r in rows:
                if all(r[c] != g[c] for g in grid for c in range(k)):
                    extend(grid + [r])
        extend([])
        _SQUARES[k] = np.asarray(found, np.int64)
    return _SQUARES[k]


def _random_latin_square(rng: np.random.Generator, k: int) -> np.ndarray:
    """A Latin square of order k by randomised backtracking (cells in order, symbols shuffled)."""
    grid = -np.ones((k, k), np.int64)

    def fill(cell):
        if cell == k * k:
            return True
        i, j = divmod(cell, k)
        for s in rng.permutation(k):
            if s not in grid[i, :j] and s not in grid[:i, j]:
                grid[i, j] = s
                if fill(cell + 1):
                    return True
        grid[i, j] = -1
        return False
    fill(0)
    return grid


TASKS: dict[str, type[Task]] = {c.name: c for c in (CopyTask, SortTask, ReverseTask, AdditionTask,
                                                     PermutationTask, LatinSquareTask)}
assert tuple(TASKS) == TASK_NAMES


def make_task(name: str, length: int = 6, num_values: int = 6, **options) -> Task:
    """The task called `name` (one of TASK_NAMES) over `length` items and `num_values` values;
    `options`: the task's own fields (addition: digit_order, operand_sizes)."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"length", "num_values"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TaskError(f"{name} has no option {', '.join(map(repr, unknown))}; its options: "
                        f"{', '.join(sorted(fields)) or 'none'}")
    return cls(length=length, num_values=num_values, **options)


def strip_eos(tokens) -> np.ndarray:
    """A 1-D answer without its trailing EOS tokens (a decoder's padding after the answer ends)."""
    a = np.asarray(tokens).reshape(-1)
    end = len(a)
    while end > 0 and a[end - 1] == EOS:
        end -= 1
    return a[:end]


def evaluate_answers(task: Task, prompts, answers, lengths=None, reference=None) -> dict:
    """Task figures of decoded answers: `validity` (fraction the task accepts), `exact_match` (fraction
    equal to `reference` answers, e.g. one-token-per-step greedy; deterministic tasks without a
    reference: equal to the expected answer) and `n`. Trailing EOS tokens are ignored.

    answers: int[B, A] token ids; lengths: int[B] answer lengths (default: all of A).
    """
    prompts, answers = np.asarray(prompts), np.asarray(answers)
    if prompts.ndim != 2 or answers.ndim != 2 or prompts.shape[0] != answers.shape[0]:
        raise TaskError(f"prompts and answers must be [B, P] and [B, A] with the same B, got "
                        f"{prompts.shape} and {answers.shape}")
    n = prompts.shape[0]
    lengths = np.full(n, answers.shape[1]) if lengths is None else np.asarray(lengths)
    cut = [answers[i, : int(lengths[i])] for i in range(n)]
    valid = [task.validate(prompts[i], cut[i]) for i in range(n)]
    out = {"n": n, "validity": float(np.mean(valid)) if n else 0.0}
    if reference is not None:
        reference = np.asarray(reference)
        out["exact_match"] = float(np.mean([np.array_equal(strip_eos(cut[i]), strip_eos(reference[i]))
                                            for i in range(n)])) if n else 0.0
    elif task.deterministic:
        out["exact_match"] = out["validity"]
    return out


def evaluate_decoder(task: Task, config, params, rule, prompts, *, reference=None, **decode_kw) -> dict:
    """Decode a task's prompts with a diffusion rule (jaxdecode.diffusion.diffusion_decode) and report
    `validity`, `exact_match` (against `reference` answers, e.g. greedy1's, else the expected answer
    of a deterministic task), mean `nfe`, `tokens_per_forward`, `seconds` (wall time of a second,
    compiled run) and the decoded `tokens`."""
    prompts = np.asarray(prompts, np.int32)
    lengths = np.full(len(prompts), prompts.shape[1], np.int32)
    out, seconds = _timed_decode(config, params, prompts, lengths, answer_length=task.answer_length, rule=rule,
                                 **decode_kw)
    tokens, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    report = evaluate_answers(task, prompts, tokens, lens, reference=reference)
    nfe = np.asarray(out.stats["nfe"], np.float64)
    report.update(nfe=float(nfe.mean()), tokens_per_forward=float(np.mean(out.stats["tokens_per_forward"])),
                  seconds=seconds, tokens=tokens)
    return report


# ----------------------------------------------------------------------------- infilling
@dataclasses.dataclass(frozen=True)
class InfillBatch:
    """Infilling inputs cut from task answers (token ids; rows right-padded with EOS)."""
    prompts: np.ndarray  # int32[B, P]: the task prompts
    prefix: np.ndarray  # int32[B, P + A - span]: prompt + the answer before the gap
    prefix_lengths: np.ndarray  # int32[B]
    span: np.ndarray  # int32[B, span]: the tokens cut out
    suffix: np.ndarray  # int32[B, A - span]: the answer after the gap
    suffix_lengths: np.ndarray  # int32[B]


@dataclasses.dataclass(frozen=True)
class InfillTask:
    """Infilling over a task's answers: `span` consecutive answer tokens are cut out at a random start;
    the decoder gets the prompt + the answer before the gap as its prompt and the answer after it as
    its suffix (diffusion_decode(..., suffix_tokens=batch.suffix, suffix_lengths=batch.suffix_lengths)).
    A filling is valid when the answer put back together is valid for the task. In a many-answer task
    the suffix decides the filling (a permutation's gap holds exactly the values missing on both
    sides), so a decoder that ignored the suffix would fail it. A model trained on the task (SFT: any
    subset of answer tokens masked) has seen such gaps."""
    task: Task
    span: int = 2

    def __post_init__(self):
        if not 1 <= self.span <= self.task.answer_length:
            raise TaskError(f"infill span must be in 1..{self.task.answer_length} (the {self.task.name} answer "
                            f"length), got {self.span}")

    def split(self, prompts, answers, starts) -> InfillBatch:
        """Cut answers[b, starts[b] : starts[b] + span] out of each row."""
        prompts, answers = np.asarray(prompts, np.int32), np.asarray(answers, np.int32)
        starts = np.asarray(starts)
        a, n, p = self.task.answer_length, self.span, prompts.shape[1]
        if answers.shape != (len(prompts), a) or np.any(starts < 0) or np.any(starts > a - n):
            raise TaskError(f"split needs answers [B, {a}] and starts in 0..{a - n}, got answers {answers.shape} "
                            f"and starts {starts.tolist()}")
        prefix = np.full((len(prompts), p + a - n), EOS, np.int32)
        suffix = np.full((len(prompts), a - n), EOS, np.int32)
        for b, s in enumerate(starts.tolist()):
            prefix[b, :p + s] = np.concatenate([prompts[b], answers[b, :s]])
            suffix[b, :a - n - s] = answers[b, s + n:]
        return InfillBatch(prompts=prompts, prefix=prefix, prefix_lengths=(p + starts).astype(np.int32),
                           span=np.stack([answers[b, s:s + n] for b, s in enumerate(starts.tolist())]),
                           suffix=suffix, suffix_lengths=(a - n - starts).astype(np.int32))

    def sample(self, rng: np.random.Generator, batch: int) -> InfillBatch:
        prompts, answers = self.task.sample(rng, batch)
        return self.split(prompts, answers, rng.integers(0, self.task.answer_length - self.span + 1, batch))

    def answers(self, batch: InfillBatch, fillings) -> list[np.ndarray]:
        """The whole answers: the answer before the gap, the filling, the answer after it."""
        p = batch.prompts.shape[1]
        return [np.concatenate([batch.prefix[b, p:batch.prefix_lengths[b]], np.asarray(fillings[b]),
                                batch.suffix[b, :batch.suffix_lengths[b]]]) for b in range(len(batch.prompts))]

    def validate(self, batch: InfillBatch, fillings) -> np.ndarray:
        """bool[B]: the answer with each row's filling (int[B, span]) in its gap is valid."""
        return np.array([self.task.validate(batch.prompts[b], ans)
                         for b, ans in enumerate(self.answers(batch, fillings))], bool)


def evaluate_infill_answers(infill: InfillTask, batch: InfillBatch, fillings, reference=None) -> dict:
    """`validity` (the answer with the filling is valid), `exact_match` (the filling equals `reference`,
    default the span cut out) and `n` of fillings int[B, span]."""
    fillings = np.asarray(fillings)
    reference = batch.span if reference is None else np.asarray(reference)
    n = len(fillings)
    return {"n": n, "validity": float(np.mean(infill.validate(batch, fillings))) if n else 0.0,
            "exact_match": float(np.mean(np.all(fillings == reference, axis=1))) if n else 0.0}


def evaluate_infill(infill: InfillTask, config, params, rule, batch: InfillBatch, *, reference=None,
                    **decode_kw) -> dict:
    """Fill a batch's gaps with a diffusion rule: evaluate_infill_answers plus mean `nfe`,
    `tokens_per_forward`, `seconds` (a second, compiled run) and the `tokens` (no EOS: every gap slot
    is filled)."""
    out, seconds = _timed_decode(config, params, batch.prefix, batch.prefix_lengths, answer_length=infill.span,
                                 rule=rule, suffix_tokens=batch.suffix, suffix_lengths=batch.suffix_lengths,
                                 **{"eos_ids": (), **decode_kw})
    tokens = np.asarray(out.tokens)
    report = evaluate_infill_answers(infill, batch, tokens, reference)
    report.update(nfe=float(np.mean(out.stats["nfe"])), seconds=seconds, tokens=tokens,
                  tokens_per_forward=float(np.mean(out.stats["tokens_per_forward"])))
    return report


def _timed_decode(*args, **kw):
    """(output, seconds) of `diffusion_decode(*args, **kw)`, timed on a second call (compile excluded)."""
    import time

    import jax

    from jaxdecode.diffusion import diffusion_decode
    jax.block_until_ready(diffusion_decode(*args, **kw).tokens)
    start = time.perf_counter()
    out = diffusion_decode(*args, **kw)
    jax.block_until_ready(out.tokens)
    return out, time.perf_counter() - start
