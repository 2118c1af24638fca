"""Corpora: source files -> tokenized memmap shards, a deterministic split, and batch sources.

Layout of a corpus directory (written to a temporary sibling, then renamed, so a crash never leaves
a half-built corpus behind):
    manifest.json            tokenizer fingerprint, vocab size, dtype, per-split shards and counts,
                             what it was built from (`sources_record`), and every file with its split
                             (or the reason it was skipped)
    train-00000.bin ...      token ids (uint16 when the vocabulary fits), documents separated by EOS
    heldout-00000.bin ...

The split is a function of the file's path relative to the corpus root only (a salted SHA-256), so
it is stable across machines, file orders and corpus growth.

Batch order is a pure function of (seed, step) (`WindowSampler`), so a resumed run sees exactly the
batches the uninterrupted run would have seen.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .files import save_whole
from .tokenizer import eos_id, tokenizer_fingerprint

SPLITS = ("train", "heldout")
MANIFEST = "manifest.json"


class CorpusError(ValueError):
    """A corpus is empty, unreadable, or does not match the tokenizer it is used with."""


# ----------------------------------------------------------------------------- files and split
def find_source_files(roots: Sequence, patterns: Sequence[str] = ("*.py",),
                      exclude_dirs: Sequence[str] = ("site-packages", "__pycache__")) -> list[tuple[Path, str]]:
    """(absolute path, path relative to its root) of every matching file, sorted by relative path."""
    found = []
    for root in roots:
        root = Path(root)
        if root.is_file():
            found.append((root.resolve(), root.name))
            continue
        if not root.is_dir():
            raise CorpusError(f"corpus path {root} does not exist; pass files or directories")
        for pat in patterns:
            for p in root.rglob(pat):
                rel = p.relative_to(root)
                if p.is_file() and not any(part in exclude_dirs for part in rel.parts):
                    found.append((p.resolve(), rel.as_posix()))
    found = sorted(set(found), key=lambda x: (x[1], str(x[0])))
    if not found:
        raise CorpusError(f"empty corpus: no files matching {list(patterns)} under "
                          f"{[str(r) for r in roots]}")
    return found


def sources_record(roots: Sequence, patterns: Sequence[str], held_out_fraction: float,
                   salt: str = "jaxdecode-split", files: list | None = None) -> dict:
    """What a tokenizer or corpus was made from: the roots (absolute), patterns, split, and a hash of
    every matching file's relative path, size and modification time (so an edited, added or removed
    file changes it)."""
    h = hashlib.sha256()
    files = find_source_files(roots, patterns) if files is None else files
    for path, rel in files:
        st = path.stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return {"roots": [str(Path(r).resolve()) for r in roots], "patterns": list(patterns),
            "held_out_fraction": held_out_fraction, "salt": salt, "files": len(files),
            "files_sha256": h.hexdigest()[:16]}


def split_of(rel_path: str, held_out_fraction: float, salt: str = "jaxdecode-split") -> str:
    """'heldout' for a fixed, hash-chosen fraction of paths; 'train' for the rest."""
    h = int(hashlib.sha256(f"{salt}:{rel_path}".encode()).hexdigest()[:8], 16)
    return "heldout" if h / 2 ** 32 < held_out_fraction else "train"


def read_text(path: Path) -> tuple[str | None, str | None]:
    """(text, None) or (None, why it was skipped). Skips are recorded in the manifest, not hidden."""
    try:
        return path.read_bytes().decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"not UTF-8: {e.reason} at byte {e.start}"
    except OSError as e:
        return None, f"unreadable: {e.strerror}"


# ----------------------------------------------------------------------------- building
def build_corpus(roots: Sequence, tokenizer, out_dir, *, held_out_fraction: float = 0.05,
                 patterns: Sequence[str] = ("*.py",), shard_tokens: int = 1 << 24,
                 salt: str = "jaxdecode-split", batch_files: int = 256) -> dict:
    """Tokenize every matching file under `roots` into `out_dir`; return the manifest."""
    if not 0.0 < held_out_fraction < 1.0:
        raise CorpusError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    files = find_source_files(roots, patterns)
    sources = sources_record(roots, patterns, held_out_fraction, salt, files)
    manifest = {"format": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "roots": [str(r) for r in roots], "patterns": list(patterns),
                "held_out_fraction": held_out_fraction, "salt": salt, "sources": sources}
    save_whole(Path(out_dir), lambda tmp: _write_corpus(manifest, files, tokenizer, tmp, shard_tokens,
                                                        batch_files))
    return manifest


def _write_corpus(manifest: dict, files, tokenizer, tmp: Path, shard_tokens: int, batch_files: int):
    """Tokenize `files` into shards and MANIFEST under `tmp`, completing `manifest` in place."""
    held_out_fraction, salt = manifest["held_out_fraction"], manifest["salt"]
    eos = eos_id(tokenizer)
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
    records, stats = [], {s: {"documents": 0, "bytes": 0} for s in SPLITS}
    backend = tokenizer.backend_tokenizer
    try:
        for start in range(0, len(files), batch_files):
            chunk = files[start:start + batch_files]
            texts, kept = [], []
            for path, rel in chunk:
                text, why = read_text(path)
                if why is not None:
                    records.append({"path": rel, "skipped": why})
                elif not text:
                    records.append({"path": rel, "skipped": "empty file"})
                else:
                    texts.append(text)
                    kept.append(rel)
            for rel, text, enc in zip(kept, texts, backend.encode_batch(texts, add_special_tokens=False)):
                split = split_of(rel, held_out_fraction, salt)
                ids = np.asarray(enc.ids + [eos], dtype=dtype)
                writers[split].write(ids)
                nbytes = len(text.encode("utf-8"))
                stats[split]["documents"] += 1
                stats[split]["bytes"] += nbytes
                records.append({"path": rel, "split": split, "bytes": nbytes, "tokens": len(ids)})
    finally:
        shards = {s: w.close() for s, w in writers.items()}
    for s in SPLITS:
        if stats[s]["documents"] == 0:
            total = sum(v["documents"] for v in stats.values())
            raise CorpusError(
                f"empty corpus: the {s} split has no documents ({total} non-empty files of "
                f"{len(files)} found); add more files or change held_out_fraction={held_out_fraction}")
    manifest.update({
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": vocab,
        "eos_id": eos, "dtype": np.dtype(dtype).name,
        "splits": {s: {**stats[s], **shards[s]} for s in SPLITS},
        "files": records,
    })
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)


class _ShardWriter:
    def __init__(self, folder: Path, split: str, dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.cap = folder, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.f = None
        self.n = 0

    def write(self, ids: np.ndarray):
        while len(ids):
            if self.f is None or self.n >= self.cap:
                self._next()
            take = ids[: self.cap - self.n]
            take.tofile(self.f)
            self.n += len(take)
            self.shards[-1]["tokens"] = self.n
            ids = ids[len(take):]

    def _next(self):
        if self.f is not None:
            self.f.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.f = open(self.folder / name, "wb")
        self.n = 0
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> dict:
        if self.f is not None:
            self.f.close()
        return {"tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}


# ----------------------------------------------------------------------------- loading
@dataclasses.dataclass(frozen=True)
class Corpus:
    path: Path
    manifest: dict

    @classmethod
    def open(cls, path) -> "Corpus":
        path = Path(path)
        mf = path / MANIFEST
        if not mf.exists():
            raise CorpusError(f"{path} is not a corpus directory (no {MANIFEST}); build one with "
                              f"training.corpus.build_corpus or `jaxdecode train lm --corpus FILES`")
        with open(mf) as f:
            manifest = json.load(f)
        return cls(path, manifest)

    def tokens(self, split: str) -> np.ndarray:
        """All token ids of a split, documents separated by EOS (memory-mapped shards, concatenated)."""
        info = self.manifest["splits"][split]
        parts = []
        for s in info["shards"]:
            f = self.path / s["file"]
            arr = np.memmap(f, dtype=self.manifest["dtype"], mode="r") if s["tokens"] else np.zeros(0)
            if len(arr) != s["tokens"]:
                raise CorpusError(f"corpus shard {f} holds {len(arr)} tokens but the manifest says "
                                  f"{s['tokens']}: the corpus is corrupt; rebuild it")
            parts.append(arr)
        out = np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])
        return out.astype(np.int32)

    def check_tokenizer(self, tokenizer) -> None:
        fp = tokenizer_fingerprint(tokenizer)
        if fp != self.manifest["tokenizer_fingerprint"]:
            raise CorpusError(
                f"tokenizer mismatch: the corpus {self.path} was tokenized with a tokenizer of "
                f"fingerprint {self.manifest['tokenizer_fingerprint']} (vocab "
                f"{self.manifest['vocab_size']}), but the given one has {fp} (vocab {len(tokenizer)}); "
                f"rebuild the corpus with this tokenizer or pass the original one")

    def num_bytes(self, split: str) -> int:
        return int(self.manifest["splits"][split]["bytes"])


# ----------------------------------------------------------------------------- batch sources
@dataclasses.dataclass(frozen=True, eq=False)
class WindowSampler:
    """Training batches: B random windows of T+1 tokens; batch `step` depends only on (seed, step)."""
    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        if len(self.tokens) < self.seq_len + 1:
            raise CorpusError(f"corpus too small: {len(self.tokens)} tokens cannot fill one window "
                              f"of seq_len + 1 = {self.seq_len + 1}; use a shorter --seq-len or more text")

    def __call__(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return {"tokens": self.tokens[idx].astype(np.int32),
                "weights": np.ones((self.batch_size, self.seq_len), np.float32)}


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 max_batches: int | None = None) -> list[dict]:
    """Held-out batches: windows of T+1 tokens overlapping by one, so each token is predicted once.

    Without `max_batches` the windows cover the whole stream: every token after the first is
    scored (the last window and batch are padded with weight-0 positions and rows, so nothing is
    dropped). With `max_batches` (periodic evaluation) the windows are spread evenly over the
    stream, so the subset samples every part of the split rather than its first files.
    """
    n_pred = len(tokens) - 1
    if n_pred < 1:
        raise CorpusError("held-out split too small to evaluate: it needs at least 2 tokens")
    n_win = -(-n_pred // seq_len)
    windows = np.arange(n_win)
    if max_batches is not None and max_batches * batch_size < n_win:
        windows = np.unique(np.linspace(0, n_win - 1, max_batches * batch_size).round().astype(int))
    out = []
    for b0 in range(0, len(windows), batch_size):
        toks = np.zeros((batch_size, seq_len + 1), np.int32)
        w = np.zeros((batch_size, seq_len), np.float32)
        for r, win in enumerate(windows[b0:b0 + batch_size]):
            piece = tokens[win * seq_len: win * seq_len + seq_len + 1]
            toks[r, :len(piece)] = piece
            w[r, :len(piece) - 1] = 1.0
        out.append({"tokens": toks, "weights": w})
    return out


def iter_texts(roots: Sequence, patterns: Sequence[str] = ("*.py",), held_out_fraction: float = 0.05,
               salt: str = "jaxdecode-split", split: str | None = "train") -> Iterable[str]:
    """Texts of the files of one split (tokenizers are trained on the training split only)."""
    for path, rel in find_source_files(roots, patterns):
        if split is not None and split_of(rel, held_out_fraction, salt) != split:
            continue
        text, why = read_text(path)
        if text:
            yield text


def sample_package_sources(packages: Sequence[str], out_dir, *, budget_bytes: int, max_file_bytes: int,
                           exclude_dirs: Sequence[str] = ("_distutils", "__pycache__"),
                           salt: str = "pkgs") -> dict:
    """Copy a fixed slice of installed packages' `*.py` files into `out_dir/<package>/` (a corpus root).

    Per package, files are taken in the order of a salted hash of "package/relative path" until
    `budget_bytes` is reached (so one large package cannot drown the others, and the slice does not
    depend on file-system order); empty files and files over `max_file_bytes` (generated tables) are
    passed over. `exclude_dirs`: vendored copies of stdlib modules (setuptools' `_distutils`) would
    leak the stdlib's held-out files into training. Packages are found without importing them.
    Returns {package: {"version", "files", "bytes"}}; a package that is not installed is an error.
    """
    import importlib.metadata
    import importlib.util
    import shutil
    out_dir = Path(out_dir)
    record = {}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(f"package {name!r} is not installed (or is a single module); install it or "
                              f"drop it from the package list")
        root = Path(list(spec.submodule_search_locations)[0])
        files = sorted((p for p in root.rglob("*.py")
                        if not any(part in exclude_dirs for part in p.relative_to(root).parts)),
                       key=lambda p: hashlib.sha256(f"{salt}:{name}/{p.relative_to(root).as_posix()}"
                                                    .encode()).hexdigest())
        taken, nbytes = 0, 0
        for path in files:
            if nbytes >= budget_bytes:
                break
            size = path.stat().st_size
            if size == 0 or size > max_file_bytes:
                continue
            dst = out_dir / name / path.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dst)
            taken, nbytes = taken + 1, nbytes + size
        record[name] = {"version": _installed_version(name), "files": taken, "bytes": nbytes}
    return record


def _installed_version(package: str) -> str:
    """The version of the distribution that installs import package `package` (PIL -> pillow)."""
    import importlib.metadata
    for dist in importlib.metadata.packages_distributions().get(package, [package]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
