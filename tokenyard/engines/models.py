"""What `--model` names and the names it is served under, for every command that takes one.

A model is `tiny` / `tiny-tools` / `tiny-reasoning` (built locally on first use), a local model
directory, or a Hugging Face hub id (`org/name`, at `--revision`), which `local_model` resolves
through huggingface_hub's cache: downloaded when the hub answers, the cached snapshot when it
does not or HF_HUB_OFFLINE=1 forbids asking. The API and the broker's lanes know it by its served
names (`--served-model-name`, as vLLM's), the first of which answers carry; none given, by
the model as it was named.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from tokenyard.errors import FatalError

TINY_MODELS = ("tiny", "tiny-tools", "tiny-reasoning")
# formats that neither transformers nor vLLM load from a hub snapshot: not downloaded (the same
# patterns when the cache is read offline, so huggingface_hub finds the snapshot complete)
NOT_LOADED = (
    "*.onnx",
    "*.onnx_data",
    "onnx/*",
    "*.gguf",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "*.tflite",
    "openvino/*",
    "coreml/*",
    "original/*",  # Meta's and Mistral's consolidated checkpoints beside the HF weights
)
# what a tokenizer alone does without (a gateway's, the remote engine's): not fetched for it
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt")
# huggingface_hub's repo-id shape (validate_repo_id): `name` or `org/name`
_HUB_ID = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?")


def local_model(model: str, revision: str | None = None, *, weights: bool = True) -> str:
    """`model` as engines load it: the tiny names and local directories as given, a hub id as
    its cached snapshot's directory (fetched first where the hub answers; `weights` False: its
    config and tokenizer only). FatalError, one line saying what to do, when it is none of them
    or neither the hub nor the cache has it."""
    if model in TINY_MODELS:
        return model
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if not is_hub_id(model):
        raise FatalError(f"model directory {model} does not exist")
    return str(_from_hub(model, revision, NOT_LOADED if weights else (*NOT_LOADED, *WEIGHTS)))


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a Hugging Face hub id rather than a path."""
    return (
        _HUB_ID.fullmatch(model) is not None
        and not model.startswith((".", "-"))
        and ".." not in model
        and "--" not in model
    )


def served_names(model: str, given: Iterable[str] = ()) -> tuple[str, ...]:
    """The names `model` is served under: those given (each may be a comma list, as in a
    TOKENYARD_*_SERVED_MODEL_NAME variable), in order and once each; else the model as named."""
    names = [n.strip() for item in given for n in item.split(",") if n.strip()]
    return tuple(dict.fromkeys(names)) or (model,)


def _from_hub(repo: str, revision: str | None, ignored: tuple[str, ...]) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    try:
        found = huggingface_hub.snapshot_download(
            repo, revision=revision, ignore_patterns=list(ignored)
        )
    except RevisionNotFoundError as exc:
        raise FatalError(f"model {repo} has no revision {revision!r} on the hub") from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise FatalError(
            f"model {repo} is neither a local directory nor a hub model this machine may read "
            "(a private or gated one needs HF_TOKEN)"
        ) from exc
    except IncompleteSnapshotError as exc:
        raise FatalError(
            f"model {repo}{at}: its cached snapshot misses files and the hub could not be "
            "reached to fetch them"
        ) from exc
    except LocalEntryNotFoundError as exc:
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE=1 forbids downloading it (unset it, or fetch it elsewhere)"
        else:
            why = f"the hub ({constants.ENDPOINT}) could not be reached to download it"
        raise FatalError(
            f"model {repo}{at} is neither a local directory nor in the Hugging Face cache "
            f"({cache}), and {why}"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:  # an incomplete snapshot, a full disk
        text = " ".join(str(exc).split())
        raise FatalError(f"model {repo}{at} could not be fetched: {text}") from exc
    return Path(found)


def parse_loras(specs: Iterable[str]) -> dict[str, str]:
    """`NAME=PATH` entries (vLLM's --lora-modules form) as {name: path}."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise FatalError(f"--lora takes NAME=PATH, got {spec!r}")
        if name in out:
            raise FatalError(f"--lora names {name!r} twice")
        out[name] = path
    return out
