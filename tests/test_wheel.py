"""Packaging: every subpackage is discovered, and a built (non-editable) wheel works on its own.

The editable install resolves imports from the source tree, so a package left out of the build
configuration only shows up in a real wheel: build one, install it into a fresh venv whose only view
of jaxdecode is that wheel, and decode from it (speculative and constrained).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    spec = importlib.util.spec_from_file_location("_jaxdecode_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() itself runs only as __main__
    return mod


def test_discovery_finds_every_subpackage():
    """Every folder with an __init__.py under the four source roots is a discovered package, and no
    folder holds .py files without an __init__.py (a namespace package would be skipped)."""
    setup = _setup_module()
    packages, package_dir = setup.discover_packages(ROOT)
    assert package_dir == {name: folder for name, folder in setup.ROOTS.items()}
    want, no_init = set(), []
    for name, folder in setup.ROOTS.items():
        for d in [ROOT / folder, *sorted(p for p in (ROOT / folder).rglob("*") if p.is_dir())]:
            if "__pycache__" in d.parts:
                continue
            dotted = ".".join([name, *d.relative_to(ROOT / folder).parts])
            if (d / "__init__.py").exists():
                want.add(dotted)
            elif any(d.glob("*.py")):
                no_init.append(dotted)
    assert not no_init, f"folders with modules but no __init__.py (would not ship): {no_init}"
    assert {"jaxdecode.drafters", "jaxdecode.constraints"} <= want
    assert sorted(packages) == sorted(want)
    # No top-level package other than jaxdecode (models/ and training/ install under it).
    assert {p.split(".")[0] for p in packages} == {"jaxdecode"}


def _copy_source(dst: Path) -> Path:
    """The project as `pip wheel .` sees it, minus local build state (keeps build/ out of the tree)."""
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", "runs", ".whl", ".ipynb_checkpoints")
    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


def _run(cmd, cwd, env=None, timeout=180) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


SDIST_SCRIPT = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"


def _check_distributions(whl: Path, src: Path, sdist_dir: Path) -> None:
    """The license text (pyproject: license-files) is in the wheel's .dist-info and in the sdist, which
    holds no tests (MANIFEST.in: the suite needs the repository around it, so none of it ships)."""
    import tarfile
    import zipfile
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        (lic,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert z.read(lic).decode() == license_text
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = z.read(meta).decode().split("\n\n")[0].splitlines()
        assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    name = _run([sys.executable, "-c", SDIST_SCRIPT, str(sdist_dir)], cwd=src, timeout=300).stdout.split()[-1]
    with tarfile.open(sdist_dir / name) as t:
        members = [m.split("/", 1)[1] for m in t.getnames() if "/" in m]
        assert t.extractfile(f"{name[:-len('.tar.gz')]}/LICENSE").read().decode() == license_text
    assert not [m for m in members if m.startswith("tests/") or m == "tests"], "the sdist ships tests"
    assert "jaxdecode/__init__.py" in members and "models/embedded/target/config.json" in members


DECODE_SCRIPT = r"""
import json, sys
import jaxdecode, jaxdecode.constraints, jaxdecode.drafters, jaxdecode.kernels, jaxdecode.training
import jaxdecode.models
site, index = sys.argv[1], sys.argv[2]
for mod in (jaxdecode, jaxdecode.constraints, jaxdecode.drafters, jaxdecode.kernels, jaxdecode.training,
            jaxdecode.models):
    assert mod.__file__.startswith(site), (mod.__name__, mod.__file__, site)
model = jaxdecode.load()  # the embedded target model ships inside the wheel
assert str(model.path).startswith(site), model.path
dllm = jaxdecode.load("dllm")  # so does the embedded diffusion LM
assert str(dllm.path).startswith(site) and dllm.config.is_diffusion, dllm.path
prompts = ["def add(a, b):\n    return a + b\n\ndef add", "import os\n"]
greedy = jaxdecode.generate(model, prompts, "greedy", max_new_tokens=8)
# adaptive=False: the default would first measure a cost table for the embedded model here (~20 s of
# compiling in this fresh process); measuring it is tested in-process (test_embedded.py, real_costs).
spec = jaxdecode.generate(model, prompts, "speculative", max_new_tokens=8, drafter="prompt_lookup",
                          tree="chain:3", adaptive=False)
constrained = jaxdecode.generate(model, ["def f("], "constrained_greedy", max_new_tokens=4, index=index)
print(json.dumps({"greedy": [g.tokens for g in greedy], "spec": [g.tokens for g in spec],
                  "constrained": constrained[0].tokens}))
"""


def test_built_wheel_installs_and_decodes(tmp_path):
    """Build the wheel, install it into a fresh venv, and from a cwd outside the source tree: import
    every subpackage, build an index with the installed console script, decode speculatively (output
    == greedy) and constrained (output is an item, then EOS) with the embedded model."""
    src = _copy_source(tmp_path / "src")
    wheels = tmp_path / "wheels"
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                  str(src)], cwd=tmp_path, timeout=300)
    # A clean build: no setuptools warnings (data folders taken for packages, deprecated fields).
    warnings = [line for line in (build.stdout + build.stderr).splitlines()
                if "Warning" in line or "would be ignored" in line]
    assert not warnings, "\n".join(warnings)
    (whl,) = wheels.glob("jaxdecode-*.whl")
    _check_distributions(whl, src, tmp_path / "sdist")

    # A fresh venv that sees the wheel first and the test venv's dependencies through a plain path
    # entry (its .pth files, the editable finder among them, are not processed).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # Install before the dependency path exists, so pip does not see the editable jaxdecode.
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", str(whl)], cwd=tmp_path,
         env=env)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=env).stdout.strip())
    (site / "_jaxdecode_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "cwd"  # not the source tree: nothing importable from the cwd
    work.mkdir()

    items = [(5, 6, 7), (5, 8), (10, 11, 12)]
    (work / "items.txt").write_text("".join(" ".join(map(str, i)) + "\n" for i in items))
    _run([str(venv / "bin" / "jaxdecode"), "index", "build", "items.txt", "--vocab-size", "4096",
          "--out", "items.npz"], cwd=work, env=env)
    out = _run([str(py), "-c", DECODE_SCRIPT, str(site), "items.npz"], cwd=work, env=env, timeout=300)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["spec"] == res["greedy"] and all(res["greedy"]), res
    *item, eos = res["constrained"]
    assert tuple(item) in items and eos == 0, res  # EOS is id 0 in the embedded tokenizer
