"""The `jaxdecode` command's usage errors and flag forms (found by using the installed wheel)."""
import json

import pytest

from jaxdecode.cli import main


def test_usage_errors_exit_2_with_the_usual_prefix(tiny_llama_dir, capsys):
    for argv, says in ((["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--option", "badformat"],
                        "--option expects KEY=VALUE"),
                       (["generate", "--model", str(tiny_llama_dir)], "give at least one --prompt"),
                       (["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--seed", "1", "--option",
                         "seed=2"], "given twice")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("jaxdecode: error: ") and says in err


def test_help_shows_the_stop_example_as_typed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--stop '\\n\\n' --logprobs" in capsys.readouterr().out


def test_json_schema_and_grammar_flags_take_text_or_a_file(tiny_llama_dir, tmp_path, capsys):
    def run(*flags):
        rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x = ", "--max-new-tokens", "3",
                   "--json", *flags])
        return rc, capsys.readouterr()
    rc, out = run("--json-schema", '{"type": "integer"}')
    assert rc == 0 and json.loads(out.out.splitlines()[0])["constraint"] == "json_schema"
    (tmp_path / "s.json").write_text('{"type": "integer"}')
    assert run("--json-schema", str(tmp_path / "s.json"))[0] == 0
    rc, out = run("--grammar", 'start: "1" ("+" "1")*')
    assert rc == 0 and json.loads(out.out.splitlines()[0])["constraint"] == "grammar"
    rc, out = run("--grammar", str(tmp_path / "missing.lark"))
    assert rc == 2 and "neither a readable file nor grammar text" in out.err
    rc, out = run("--json-schema", "nope.json")
    assert rc == 2 and "neither a readable file nor JSON text" in out.err


def test_a_local_directory_named_like_an_embedded_model_wins(tiny_llama_dir, tmp_path, monkeypatch):
    """`jaxdecode train draft-lm --out draft`, then `--draft draft`: the user's directory, not the embedded
    draft model of the same name."""
    import shutil

    import jaxdecode
    shutil.copytree(tiny_llama_dir, tmp_path / "draft")
    monkeypatch.chdir(tmp_path)
    assert jaxdecode.load("draft").path == "draft"
    monkeypatch.chdir(tmp_path / "draft")  # no ./draft here: the embedded model
    assert jaxdecode.load("draft").path != "draft"


def test_no_torch_advice_on_a_machine_without_torch(tiny_llama_dir):
    """jaxdecode uses transformers only for tokenizers: without torch (a plain wheel install) its "PyTorch
    was not found" line would print on every command, saying nothing that applies."""
    import os
    import subprocess
    import sys
    code = ("import sys, os; sys.modules['torch'] = None; import jaxdecode; "
            f"jaxdecode.load({str(tiny_llama_dir)!r}); assert 'TRANSFORMERS_NO_ADVISORY_WARNINGS' not in os.environ")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}  # conftest quiets it
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "PyTorch was not found" not in run.stderr
