"""The tokenizer side of a Hugging Face model, loaded without its weights (gateways need it)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase, TokenizersBackend

from tokenyard.engines.base import ChatRender, EngineTokenizer
from tokenyard.engines.models import local_model
from tokenyard.engines.tiny import ensure_tiny_model


class HFTokenizer(EngineTokenizer):
    """Adapts a transformers tokenizer to the EngineTokenizer protocol; safe across threads."""

    def __init__(
        self,
        tok: PreTrainedTokenizerBase,
        max_model_len: int,
        eos_ids: Sequence[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self.hf = tok
        # the model's embedding may have fewer rows than the tokenizer has entries, or more
        self.vocab_size = min(len(tok), vocab_size) if vocab_size else len(tok)
        # The Rust tokenizer is mutably borrowed by encode (truncation/padding settings), so
        # concurrent calls from the engine thread and the event loop can fail: serialise them.
        self._lock = threading.Lock()
        self.max_model_len = max_model_len
        self._texts: dict[int, str] = {}  # token_text's answers; at most the vocabulary
        self._rust = _plain_backend(tok)
        self._added: frozenset[int] | None = None
        ids = {int(i) for i in eos_ids}
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        self.eos_token_ids = frozenset(ids)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.hf.eos_token_id
        return None if eos is None else int(eos)

    @property
    def pad_token_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else min(self.eos_token_ids, default=0)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt; BOS is added unless the text (a chat template) starts with it.
        `add_special_tokens` True or False: as the tokenizer's own switch (vLLM's field)."""
        if add_special_tokens is None:
            bos = self.hf.bos_token
            add_special_tokens = not (isinstance(bos, str) and bos and text.startswith(bos))
        with self._lock:
            rust = self._rust
            # transformers' encode sets the truncation, padding and special-token switches on
            # the Rust tokenizer, then encodes there; where they are already as it would set
            # them (always, but after an `encode_truncated`) the Rust call alone gives the
            # same ids at a third of the cost, per request on the gateway's event loop
            if (
                rust is not None
                and rust.truncation is None
                and rust.padding is None
                and rust.encode_special_tokens == self.hf.split_special_tokens
            ):
                return rust.encode(text, add_special_tokens=add_special_tokens).ids
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_truncated(self, text: str, keep: int, side: str = "left") -> list[int]:
        """Token ids of a prompt cut to `keep` tokens on `side` ("left" keeps the last, vLLM's
        `truncate_prompt_tokens`), its special tokens kept as the tokenizer's truncation keeps
        them."""
        bos = self.hf.bos_token
        add_special = not (isinstance(bos, str) and bos and text.startswith(bos))
        with self._lock, self._truncating(side):
            ids = list(
                self.hf.encode(
                    text, add_special_tokens=add_special, truncation=True, max_length=keep
                )
            )
        # fewer than its special tokens: cut the ids themselves
        return ids if len(ids) <= keep else (ids[-keep:] if side == "left" else ids[:keep])

    def encode_pair(
        self, first: str, second: str, keep: int | None = None, side: str | None = None
    ) -> tuple[list[int], int]:
        """Token ids of a text pair as a cross-encoder reads it (the tokenizer's own pair
        encoding: BERT's [CLS] a [SEP] b [SEP]), cut to `keep` tokens if given, and where the
        second text starts (its token type ids' first 1; none: the end). As vLLM's score
        route cuts a pair: with no `side`, the tokenizer's own pair truncation (its side,
        longest text first, special tokens kept); with one, the whole encoding's ids and
        token types sliced on that side."""
        with self._lock:
            enc = self.hf(
                first,
                second,
                truncation=keep is not None and side is None,
                max_length=keep if side is None else None,
                return_token_type_ids=True,
            )
        ids = [int(i) for i in enc["input_ids"]]
        types = list(enc.get("token_type_ids") or [0] * len(ids))
        if keep is not None and side is not None and keep < len(ids):
            cut = slice(-keep, None) if side == "left" else slice(0, keep)
            ids, types = ids[cut], types[cut]
        return ids, next((i for i, t in enumerate(types) if t == 1), len(ids))

    @contextlib.contextmanager
    def _truncating(self, side: str) -> Iterator[None]:
        """The tokenizer truncating on `side` for the duration (under `_lock`)."""
        was = self.hf.truncation_side
        self.hf.truncation_side = side
        try:
            yield
        finally:
            self.hf.truncation_side = was

    def encode_special(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` with special tokens (BOS) added or not, as asked (/tokenize)."""
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's own strings of `ids` (byte-level BPE's 'Ġ' kept), as vLLM's
        /tokenize shows them in `token_strs`."""
        with self._lock:
            out = self.hf.convert_ids_to_tokens(list(ids))
        return [str(p) for p in out]

    def text_of(self, ids: list[int], skip_special: bool, spaces_between_special: bool) -> str:
        """The text of token ids. `spaces_between_special` False: a special token right
        after another is its bare text, without any space the decoder would put before it
        (vLLM's rule for fast tokenizers)."""
        if skip_special or spaces_between_special:
            return self._decode(ids, skip_special)
        special = self._special_ids()
        # each run that starts at a special token following another decodes on its own: a
        # decoder puts no space before the first token it decodes
        starts = [0] + [
            i for i in range(1, len(ids)) if ids[i] in special and ids[i - 1] in special
        ]
        ends = [*starts[1:], len(ids)]
        return "".join(self._decode(ids[a:b], False) for a, b in zip(starts, ends, strict=True))

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        with self._lock:
            if self._rust is not None:
                # what transformers' decode comes to without its clean-up, at a third of the
                # cost: twice per run of streamed tokens (engines/detok.py)
                return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
            out = self.hf.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        assert isinstance(out, str)
        return out

    def _special_ids(self) -> frozenset[int]:
        """The added tokens' ids (vLLM's `added_token_ids`: special or not)."""
        if self._added is None:
            self._added = frozenset(int(i) for i in self.hf.added_tokens_decoder)
        return self._added

    def token_text(self, token_id: int) -> str:
        # vLLM's decoded token: the piece's string (byte-level BPE's 'Ġ' is a space)
        text = self._texts.get(token_id)
        if text is None:
            with self._lock:
                piece = self.hf.convert_ids_to_tokens(token_id)
                text = self.hf.convert_tokens_to_string([piece]) if isinstance(piece, str) else ""
            self._texts[token_id] = text
        return text

    def render_chat(self, chat: ChatRender) -> str:
        with self._lock:
            out = self.hf.apply_chat_template(
                [dict(m) for m in chat.messages],
                tools=[dict(t) for t in chat.tools] if chat.tools else None,
                tokenize=False,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                chat_template=chat.chat_template,
                **chat.variables,
            )
        assert isinstance(out, str)
        return out

    @property
    def chat_template(self) -> str:
        template = self.hf.chat_template
        if isinstance(template, dict):  # named templates (e.g. "default" and "tool_use")
            return "\n".join(str(t) for t in template.values())
        return template or ""


def resolve_model_path(
    model: str | os.PathLike[str], revision: str | None = None, *, weights: bool = True
) -> Path:
    """The model's local directory: 'tiny' builds the local tiny model ('tiny-tools': the same
    with a chat template that shows tools, as Hermes does; 'tiny-reasoning': with <think>
    tokens and a reasoning model's template too); a directory as given; a Hugging
    Face hub id through its cache (`engines/models.py` `local_model`; `weights` False: what the
    tokenizer needs only)."""
    if str(model) == "tiny":
        return ensure_tiny_model()
    if str(model) == "tiny-tools":
        return ensure_tiny_model(tools=True)
    if str(model) == "tiny-reasoning":
        return ensure_tiny_model(reasoning=True)
    return Path(local_model(str(model), revision, weights=weights))


def _plain_backend(tok: PreTrainedTokenizerBase) -> Tokenizer | None:
    """A fast tokenizer's Rust tokenizer, where its class keeps transformers' own encode and
    decode (which, for the calls made here, add nothing to the Rust tokenizer's); None for a
    tokenizer that overrides them, or a slow one."""
    cls = type(tok)
    plain = (
        isinstance(tok, TokenizersBackend)
        and cls.encode is PreTrainedTokenizerBase.encode
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls._decode is TokenizersBackend._decode
    )
    backend = getattr(tok, "backend_tokenizer", None) if plain else None
    return backend if isinstance(backend, Tokenizer) else None


def model_context(path: Path) -> tuple[int, list[int], int]:
    """The model's context length, end-of-sequence ids and vocabulary size, from its config."""
    config = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    length = int(getattr(config, "max_position_embeddings", 0) or 2048)
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return length, eos_ids, int(getattr(config, "vocab_size", 0) or 0)


def load_hf_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer of a local model directory, with its context, EOS ids and vocabulary."""
    max_len, eos_ids, vocab = model_context(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return HFTokenizer(tok, max_len, eos_ids, vocab)
