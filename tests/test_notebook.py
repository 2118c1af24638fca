"""The notebooks run top to bottom on CPU (the training ones at tiny sizes)."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "[greedy]" in outputs and "[beam]" in outputs and "target_calls" in outputs
    assert "finish: stop" in outputs and "logprob" in outputs and "speculative == greedy: True" in outputs
    assert "stream == one-shot: True" in outputs


TRAINING = NOTEBOOK.parent / "speculative_training.ipynb"


def test_speculative_training_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDECODE_NOTEBOOK_TINY", "1")  # the kernel inherits it: tiny target and steps
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # its mkdtemp work dir goes with the test's
    nb = nbformat.read(TRAINING, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "draft_lm (on-policy)" in outputs and "prompt_lookup" in outputs and "tau" in outputs
    assert "medusa " in outputs and "not available" not in outputs  # the heads trained too


DIFFUSION = NOTEBOOK.parent / "diffusion.ipynb"


def test_diffusion_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDECODE_NOTEBOOK_TINY", "1")  # one tiny task dLLM, a few steps and prompts
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # its mkdtemp work dir goes with the test's
    nb = nbformat.read(DIFFUSION, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    for rule in ("greedy1", "llada:2", "threshold:0.9", "learn2pd", "freedave"):
        assert f"permutation  {rule}" in outputs, rule  # a row of the rules table
    assert "tok/fwd" in outputs and "seen" in outputs and "none" in outputs
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {})]
    assert figures  # validity against forwards per token


STRUCTURED = NOTEBOOK.parent / "structured.ipynb"


def test_structured_notebook_runs(tmp_path):
    nb = nbformat.read(STRUCTURED, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    lines = [line for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             for line in o.get("text", "").splitlines()]
    for tag in ("[regex]", "[json]", "[json per row]", "[grammar]", "[speculative]"):
        rows = [line for line in lines if line.startswith(tag)]
        assert rows and all("valid=True" in line for line in rows), (tag, rows)
    assert sum(line.startswith("[error]") for line in lines) == 3
