"""Artefacts written whole or not at all: a temporary sibling directory, renamed when complete
(trained-drafter directories, HF exports, corpora, tokenizers)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def default_cache_dir() -> Path:
    """The root of every jaxdecode cache on disk (cost tables, tree="auto" trials, compiled automata and
    grammars): $JAXDECODE_CACHE_DIR, else $JAXDECODE_CACHE (its earlier name), else
    $XDG_CACHE_HOME/jaxdecode, else ~/.cache/jaxdecode."""
    for name in ("JAXDECODE_CACHE_DIR", "JAXDECODE_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxdecode"


def save_whole(out_dir, write: Callable[[Path], object]) -> Path:
    """`write(tmp_dir)` into a fresh temporary sibling of `out_dir`, then put it in `out_dir`'s place.

    `out_dir` never holds a half-written result: a failure in `write` leaves it as it was (and no
    temporary behind). A crash between the two renames leaves no `out_dir` at all, which the next run
    treats as missing, never as complete.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} is a file, not a directory: the output is a directory; choose "
                                 f"another path (nothing was written)")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
