"""A Hugging Face hub cache built locally, as huggingface_hub lays one out, holding the tiny
model under a hub id: `--model org/name` is then resolved from it with HF_HUB_OFFLINE=1 (the
tests have no network)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from tokenyard.engines.tiny import ensure_tiny_model

REPO = "tokenyard-tests/tiny-llama"


def hub_cache(root: Path, repo: str = REPO, *, branch: str = "main", tag: str = "") -> str:
    """Put the tiny model into the hub cache at `root` (HF_HUB_CACHE) as `repo`'s snapshot on
    `branch`; returns the snapshot's commit hash. `tag`: a second commit, the same files,
    reachable only by that ref."""
    storage = root / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{branch}".encode()).hexdigest()
    _snapshot(storage, commit, branch)
    if tag:
        _snapshot(storage, hashlib.sha1(f"{repo}@{tag}".encode()).hexdigest(), tag)
    return commit


def _snapshot(storage: Path, commit: str, ref: str) -> None:
    # files in blobs/ by content hash, linked from snapshots/<commit>/, the ref naming the commit
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for source in ensure_tiny_model().iterdir():
        blob = storage / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(source, blob)
        link = snapshot / source.name
        if not link.exists():
            link.symlink_to(Path("..", "..", "blobs", blob.name))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
