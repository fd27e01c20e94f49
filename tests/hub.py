"""A Hugging Face hub cache built locally, as huggingface_hub lays one out, holding the tiny
model under a hub id: `--model org/name` is then resolved from it with HF_HUB_OFFLINE=1 (the
tests have no network)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from tokenyard.engines.tiny import ensure_tiny_model

REPO = "tokenyard-tests/tiny-llama"


def hub_cache(
    root: Path, repo: str = REPO, *, branch: str = "main", tag: str = "", weights: bool = True
) -> str:
    """Put the tiny model into the hub cache at `root` (HF_HUB_CACHE) as `repo`'s snapshot on
    `branch`; returns the snapshot's commit hash. `tag`: a second commit, the same files,
    reachable only by that ref. `weights` False: the snapshot lacks model.safetensors, which
    the repo's cached file listing names (as a tokenizer-only fetch leaves it)."""
    storage = root / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{branch}".encode()).hexdigest()
    _snapshot(storage, commit, branch)
    if tag:
        _snapshot(storage, hashlib.sha1(f"{repo}@{tag}".encode()).hexdigest(), tag)
    if not weights:
        _list_files(storage, commit)
        (storage / "snapshots" / commit / "model.safetensors").unlink()
    return commit


def _list_files(storage: Path, commit: str) -> None:
    # huggingface_hub's own record of the repo's files at a commit, which it checks a cached
    # snapshot against (the one private API used: it is what a real fetch writes)
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    snapshot = storage / "snapshots" / commit
    entries = {
        f.name: TreeCacheEntry(
            size=f.stat().st_size,
            blob_id=hashlib.sha1(f.read_bytes()).hexdigest(),
            lfs_sha256=None,
            lfs_size=None,
            xet_hash=None,
        )
        for f in snapshot.iterdir()
    }
    write_tree_cache(str(storage), commit, entries)


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
