"""The tiny local model: deterministic, atomic, reused; and its tokenizer through HFTokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tokenyard.engines.detok import REPLACEMENT, IncrementalDetokenizer
from tokenyard.engines.hf_tokenizer import HFTokenizer
from tokenyard.engines.tiny import ensure_tiny_model


def digest(path: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((path / name).read_bytes()).hexdigest()
        for name in ("model.safetensors", "tokenizer.json", "config.json")
    }


def load_tokenizer(path: Path) -> HFTokenizer:
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), 2048)


def test_build_is_deterministic_and_reused(tiny_model_path: Path, tmp_path: Path) -> None:
    other = ensure_tiny_model(tmp_path / "tiny")
    assert digest(other) == digest(tiny_model_path)
    stamp = (other / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path / "tiny") == other
    assert (other / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tokenyard.engines import tiny

    monkeypatch.setenv("TOKENYARD_CACHE_DIR", str(tmp_path))
    assert tiny.default_cache_dir() == tmp_path
    monkeypatch.delenv("TOKENYARD_CACHE_DIR")
    assert tiny.default_cache_dir() == Path.home() / ".cache" / "tokenyard"


def test_same_outputs_twice(tiny_model_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_model_path)
    ids = torch.tensor([tok.encode("The queue holds")])
    runs = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        runs.append(out[0].tolist())
    assert runs[0] == runs[1] and len(runs[0]) == ids.shape[1] + 12


def test_tokenizer_interface(tiny_model_path: Path) -> None:
    tok = load_tokenizer(tiny_model_path)
    assert tok.eos_token_id is not None and tok.eos_token_id in tok.eos_token_ids
    text = "Le café est très chaud 🚀"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat.startswith("<|bos|>") and chat.endswith("<|assistant|>\n")
    ids = tok.encode(chat)
    assert ids.count(tok.hf.bos_token_id) == 1  # the template's BOS is not doubled
    assert tok.decode(ids) == "\nhello\n\n"  # special tokens are skipped in text


def test_incremental_detok_with_real_tokenizer(tiny_model_path: Path) -> None:
    tok = load_tokenizer(tiny_model_path)
    text = "ok 🦀 ॐ ∮ done"  # characters outside the training corpus: split into byte tokens
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith(REPLACEMENT) for i in ids)
    detok = IncrementalDetokenizer(tok.decode, prompt_ids=tok.encode("prefix "))
    pieces = [detok.push([i]) for i in ids]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
