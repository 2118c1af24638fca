"""Synthetic dLLM tasks (jaxdecode.dllm_tasks): generators, expected answers and validators."""
import numpy as np
import pytest

from jaxdecode.dllm_tasks import (EOS, FIRST_VALUE, MASK, SEP, TASK_NAMES, TaskError, _latin_squares,
                                  evaluate_answers, make_task)


def _task(name):
    return make_task(name, length=3 if name == "latin_square" else 5, num_values=6)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_generated_answers_validate_and_shapes(name):
    task = _task(name)
    prompts, answers = task.sample(np.random.default_rng(0), 32)
    assert prompts.shape == (32, task.prompt_length) and answers.shape == (32, task.answer_length)
    assert prompts.dtype == np.int32 and np.all(prompts[:, -1] == SEP)
    assert np.all(answers >= FIRST_VALUE) and np.all(answers < task.vocab.size)
    assert not np.any(prompts == MASK)
    assert all(task.validate(p, a) for p, a in zip(prompts, answers))
    assert task.validate(prompts[0], np.concatenate([answers[0], [EOS, EOS]]))  # trailing EOS: padding
    if task.deterministic:
        for p, a in zip(prompts, answers):
            np.testing.assert_array_equal(task.expected(p), a)
    else:
        assert task.expected(prompts[0]) is None
        assert len({tuple(a) for a in answers}) > 1  # many answers: training draws different ones


@pytest.mark.parametrize("name", TASK_NAMES)
def test_validators_reject_wrong_answers(name):
    task = _task(name)
    prompts, answers = task.sample(np.random.default_rng(1), 16)
    p, a = prompts[0], answers[0].copy()
    assert not task.validate(p, a[:-1])  # short
    assert not task.validate(p, np.concatenate([a, a[:1]]))  # long
    assert not task.validate(p, np.where(np.arange(len(a)) == 0, MASK, a))  # a non-value token
    dup = a.copy()
    dup[1] = dup[0] if dup[1] != dup[0] else FIRST_VALUE + (dup[0] - FIRST_VALUE + 1) % task.num_values
    assert not task.validate(p, dup)  # one position changed


def test_known_answers():
    sort, rev, add = make_task("sort", 4, 6), make_task("reverse", 4, 6), make_task("addition", 3, 10)
    v = lambda *xs: np.asarray(xs) + FIRST_VALUE
    np.testing.assert_array_equal(sort.expected(sort.encode_body([3, 1, 2, 1])), v(1, 1, 2, 3))
    np.testing.assert_array_equal(rev.expected(rev.encode_body([3, 1, 2, 0])), v(0, 2, 1, 3))
    p = add.encode_body([9, 9, 5, 0, 0, 7])  # 995 + 7 = 1002 in base 10
    np.testing.assert_array_equal(add.expected(p), v(1, 0, 0, 2))
    perm = make_task("permutation", 3, 6)
    p = perm.encode_body([0, 2, 5])
    assert perm.validate(p, v(5, 0, 2)) and not perm.validate(p, v(5, 5, 2)) and not perm.validate(p, v(0, 1, 2))
    latin = make_task("latin_square", 3, 6)
    p = latin.encode_body([1, 2, 4])
    assert latin.validate(p, v(1, 2, 4, 2, 4, 1, 4, 1, 2))
    assert not latin.validate(p, v(1, 2, 4, 2, 4, 1, 1, 2, 4))  # rows fine, columns repeat
    assert not latin.validate(p, v(1, 2, 4, 1, 2, 4, 1, 2, 4))


def test_latin_square_enumeration():
    assert len(_latin_squares(3)) == 12 and len(_latin_squares(4)) == 576
    task = make_task("latin_square", 5, 6)  # k = 5: randomised search, still valid
    prompts, answers = task.sample(np.random.default_rng(0), 4)
    assert all(task.validate(p, a) for p, a in zip(prompts, answers))


def test_bad_input_errors():
    with pytest.raises(TaskError, match="unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(TaskError, match="length <= num_values"):
        make_task("permutation", length=7, num_values=6)
    with pytest.raises(TaskError, match="length must be >= 1"):
        make_task("copy", length=0)
    copy, sort = make_task("copy", 4, 6), make_task("sort", 4, 6)
    p = copy.encode_body([1, 2, 3, 0])
    with pytest.raises(TaskError, match="not a sort prompt"):
        sort.validate(p, p[1:-1])
    with pytest.raises(TaskError, match="must have 6 tokens"):
        copy.validate(p[:-1], p[1:-1])
    perm = make_task("permutation", 3, 6)
    with pytest.raises(TaskError, match="distinct and increasing"):
        perm.validate(perm.encode_body([2, 1, 0]), perm.encode_body([2, 1, 0])[1:-1])


def test_evaluate_answers():
    task = make_task("copy", 4, 6)
    prompts, answers = task.sample(np.random.default_rng(3), 4)
    wrong = answers.copy()
    wrong[0, 0] = FIRST_VALUE + (wrong[0, 0] - FIRST_VALUE + 1) % 6
    r = evaluate_answers(task, prompts, wrong)
    assert r == {"n": 4, "validity": 0.75, "exact_match": 0.75}
    r = evaluate_answers(task, prompts, wrong, lengths=[4, 4, 3, 4], reference=answers)
    assert r["validity"] == 0.5 and r["exact_match"] == 0.5


def test_addition_digit_orders_and_operand_sizes():
    v = lambda *xs: np.asarray(xs) + FIRST_VALUE
    msd, lsd = make_task("addition", 3, 10), make_task("addition", 3, 10, digit_order="lsd")
    np.testing.assert_array_equal(lsd.expected(lsd.encode_body([5, 9, 9, 7, 0, 0])), v(2, 0, 0, 1))  # 995 + 7
    prompts, answers = msd.sample(np.random.default_rng(0), 16)
    for p, a in zip(prompts, answers):  # the same sums, every number mirrored
        a_digits, b_digits = p[1:4], p[5:8]
        mirrored = lsd.encode_body(np.concatenate([a_digits[::-1], b_digits[::-1]]) - FIRST_VALUE)
        assert lsd.validate(mirrored, a[::-1])
        np.testing.assert_array_equal(lsd.expected(mirrored), a[::-1])
    # mixed operand sizes: a training curriculum whose prompts are prompts of the full task
    for order in ("msd", "lsd"):
        mixed, full = (make_task("addition", 6, 8, digit_order=order, operand_sizes=s) for s in ("mixed", "full"))
        prompts, answers = mixed.sample(np.random.default_rng(1), 400)
        assert all(full.validate(p, a) for p, a in zip(prompts, answers))
        ops = np.stack([prompts[:, 1:7], prompts[:, 8:14]], 1) - FIRST_VALUE  # [B, 2 operands, 6 digits]
        top = ops[..., 0] if order == "msd" else ops[..., -1]  # each operand's most significant digit
        assert 0.4 < np.mean(top == 0) < 0.6  # P = 1/2 * 5/6 short + 7/12 * 1/8 a drawn zero ~ 0.49 ...
        assert np.mean(top > 0) > 0.4  # ... and full-size operands still occur
    assert msd.options == {} and lsd.options == {"digit_order": "lsd"}  # a run's identity (train_task_dllm)
    with pytest.raises(TaskError, match="digit_order must be one of"):
        make_task("addition", 3, 10, digit_order="reversed")
    with pytest.raises(TaskError, match="operand_sizes must be one of"):
        make_task("addition", 3, 10, operand_sizes="small")
    with pytest.raises(TaskError, match="copy has no option 'digit_order'; its options: none"):
        make_task("copy", 3, 10, digit_order="lsd")
