"""The embedded target's package phase: its package slice, its recipe, and the report rows it adds."""
import pytest

from jaxdecode.training import recipe
from jaxdecode.training.compression import OUTSIDE_PACKAGES
from jaxdecode.training.corpus import CorpusError, sample_package_sources, split_of
from jaxdecode.training.report import _previous_release_rows, _reusable_rows


def test_the_package_phase_never_trains_on_the_outside_sample():
    assert not set(recipe.PACKAGES) & set(OUTSIDE_PACKAGES)
    assert recipe.phase_corpus("target-3") == "corpus-packages" and recipe.phase_corpus("target-2") == "corpus"
    assert [d for d, _ in recipe.phases("target")][-1] in recipe.PACKAGE_PHASES


def test_package_slice_is_capped_fixed_and_skips_vendored_stdlib(tmp_path):
    a = sample_package_sources(["_pytest", "setuptools"], tmp_path / "a", budget_bytes=60_000, max_file_bytes=30_000)
    b = sample_package_sources(["_pytest", "setuptools"], tmp_path / "b", budget_bytes=60_000, max_file_bytes=30_000)
    assert a == b and a["_pytest"]["version"] != "unknown"  # the distribution's version (pytest), not "unknown"
    files = sorted(p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*.py"))
    assert files == sorted(p.relative_to(tmp_path / "b").as_posix() for p in (tmp_path / "b").rglob("*.py"))
    assert not any("_distutils" in f for f in files)
    for name, rec in a.items():
        sizes = [p.stat().st_size for p in (tmp_path / "a" / name).rglob("*.py")]
        assert len(sizes) == rec["files"] and sum(sizes) == rec["bytes"]
        assert max(sizes) <= 30_000 and sum(sizes) - max(sizes) < 60_000  # stops once over the budget
    # a package file's split is decided by its path under the root, like a stdlib file's
    assert {split_of(f, 0.05) for f in files} <= {"train", "heldout"}
    with pytest.raises(CorpusError, match="not installed"):
        sample_package_sources(["no_such_package_xyz"], tmp_path / "c", budget_bytes=1, max_file_bytes=1)


def test_report_keeps_the_previous_release_row_and_never_mislabels_a_rerun():
    row = lambda v: {"bits_per_byte": v}  # noqa: E731
    earlier = {"context": 256, "splits": {"heldout": {"files": 3, "bytes": 10,
                                                      "models": {"target": row(1.8), "draft": row(1.9)}}}}
    prev = {"models": {"target": {"phase": 2, "phase_step": 500}}}
    now = {"target": {"phase": 3, "phase_step": 1700}}
    rows = {"draft": "draft"} | _previous_release_rows(prev, now, ["target"])
    assert rows == {"draft": "draft", "target, previous release": "target"}
    reuse = _reusable_rows(earlier, rows)
    assert reuse["heldout"] == {"draft": row(1.9), "target, previous release": row(1.8), "_files": (3, 10)}
    # the same report rerun: the previous release stays the old weights' row, not the new ones'
    earlier["splits"]["heldout"]["models"] = {"target": row(1.5), "target, previous release": row(1.8)}
    rerun = _previous_release_rows({"models": {"target": now["target"]}}, now, ["target"])
    assert _reusable_rows(earlier, rerun)["heldout"]["target, previous release"] == row(1.8)
    assert _reusable_rows({**earlier, "context": 128}, rerun) == {}  # scored another way: not comparable


def test_the_card_tells_a_distilled_draft_from_a_from_scratch_one():
    import json
    from pathlib import Path

    from jaxdecode.training.report import model_card
    report = json.loads((Path(__file__).resolve().parents[1] / "models/embedded/metrics.json").read_text())
    scratch = {**report["models"]["draft"], "phases": [{"workdir": "draft", "steps": 600, "learning_rate": 0.003,
                                                        "warmup_steps": 30, "seed": 1, "corpus": "corpus"}]}
    scratch.pop("distilled", None)
    report["models"]["draft"] = scratch
    card = model_card(report)
    assert "The draft is trained from\nscratch, not distilled" in card and "own continuations" not in card
    acc = [{"step": 500, "tau": 1.9, "accept_by_depth": [0.5], "eval_loss": 5.0},
           {"step": 1000, "tau": 2.5, "accept_by_depth": [0.6], "eval_loss": 4.9}]
    report["models"]["draft"] = {**scratch, "phases": [{"workdir": "draft-distilled", "steps": 1000,
                                                        "learning_rate": 0.003, "warmup_steps": 50, "seed": 0,
                                                        "corpus": "self"}],
                                 "distilled": {"data": "self", "num_prompts": 8192, "prompt_len": 32,
                                               "new_tokens": 64, "temperature": 0.7, "greedy_fraction": 0.5,
                                               "continuation_tokens": 524288, "date": "2026-11-26",
                                               "heldout_acceptance": acc}}
    card = model_card(report)
    assert "distilled on-policy" in card and "not distilled" not in card
    assert "1000, 0.003, 50, 0 (the target's own continuations)" in card  # the phase names its data
    assert "tau 1.90 at step 500, 2.50 at step 1000" in " ".join(card.split())
    assert "8192 training-split prompts" in " ".join(card.split())
