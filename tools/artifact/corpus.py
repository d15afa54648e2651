"""The training corpus: Python source files already installed on the machine, split into train and held-out by file.

Owns: which files count (roots, order, filters), the train/held-out rule, and reading them as text. Does not own:
tokenization (train_tokenizer.py, train_target.py) or the held-out prompt set (prompts.py).

The split is a pure function of a file's path relative to its root (`json/decoder.py`, `torch/nn/functional.py`),
so the tokenizer trained on one machine's standard library and the model trained on another machine's standard
library plus site-packages agree on which files were never seen in training. Files with identical text are kept
once (the first in walk order), so no text sits on both sides of the split.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# 1 file in 20 is held out. A hash rather than a sorted-list position keeps a file's side fixed when other files
# come and go between machines and Python versions.
HELD_OUT_MODULUS = 20

# Generated tables (unicode data, vendored minified code) teach nothing about Python and dominate by size.
MAX_FILE_BYTES = 512 * 1024

# Not part of the library proper: installed packages live under the stdlib path on some layouts, and vendored
# copies of pip/setuptools would repeat the same sources many times.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "_vendor"})


@dataclass(frozen=True)
class SourceFile:
    """One Python file: where it is, its path relative to its root (the split key), and its text."""

    root: str
    rel: str
    text: str


def is_held_out(rel: str) -> bool:
    """True when the file at this root-relative POSIX path belongs to the held-out side."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_MODULUS == 0


def default_roots(site_packages: bool) -> list[str]:
    """The standard library, and with `site_packages` the installed packages of this interpreter."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"]]
    if site_packages:
        for key in ("purelib", "platlib"):
            if paths[key] not in roots:
                roots.append(paths[key])
    return roots


def _walk(root: str) -> Iterator[str]:
    """Root-relative POSIX paths of the .py files under root, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes the walk order, so the corpus order is the same on every run.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(os.path.relpath(os.path.join(dirpath, name), root)).as_posix()


def _read(path: str) -> str | None:
    """The file's text, or None for files that are too large, not UTF-8, or binary."""
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        data = Path(path).read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or not text.strip():
        return None
    return text


def load(roots: list[str]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out) files under the given roots, each list in a fixed order, duplicates removed."""
    train: list[SourceFile] = []
    held: list[SourceFile] = []
    seen: set[bytes] = set()
    for root in roots:
        for rel in _walk(root):
            text = _read(os.path.join(root, rel))
            if text is None:
                continue
            key = hashlib.sha256(text.encode("utf-8")).digest()
            if key in seen:
                continue
            seen.add(key)
            (held if is_held_out(rel) else train).append(SourceFile(root, rel, text))
    return train, held


def capped(files: list[SourceFile], max_bytes: int) -> list[SourceFile]:
    """At most max_bytes of text: files taken in path-hash order (no library favoured), kept in corpus order."""
    if sum(len(f.text) for f in files) <= max_bytes:
        return files
    keep: set[int] = set()
    total = 0
    for i in sorted(range(len(files)), key=lambda i: hashlib.sha256(files[i].rel.encode("utf-8")).digest()):
        if total + len(files[i].text) > max_bytes:
            continue
        keep.add(i)
        total += len(files[i].text)
    return [f for i, f in enumerate(files) if i in keep]
