"""vLLM's own routes beside the OpenAI API: /tokenize and /detokenize. Their request models take
vLLM's fields (vllm/entrypoints/openai/protocol.py) and refuse by name those tokenyard does not
implement; their answers have vLLM's shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import Field

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import unsupported
from tokenyard.gateway.protocol import ChatMessage, NonEmptyStr, Request


@runtime_checkable
class PieceTokenizer(Protocol):
    """A tokenizer that shows its raw pieces and encodes with special tokens as asked (the hf
    one; the simulator's byte tokenizer has neither, nor needs them)."""

    def encode_special(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def pieces(self, ids: Sequence[int]) -> list[str]: ...


class _Tokenize(Request):
    model: NonEmptyStr | None = None
    return_token_strs: bool | None = False


class TokenizeCompletionRequest(_Tokenize):
    """POST /tokenize with a prompt: its token ids as a completion's job would get them."""

    prompt: str
    add_special_tokens: bool = True

    def refuse_unsupported(self) -> None:
        self.refuse_unknown()


class TokenizeChatRequest(_Tokenize):
    """POST /tokenize with messages: the chat template's prompt, tokenized."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        self.refuse_unknown()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        # the template is rendered as a chat completion's prompt is: with the generation
        # prompt, the model's own template, no extra arguments
        if not self.add_generation_prompt:
            raise unsupported("add_generation_prompt", "other than true")
        if self.continue_final_message:
            raise unsupported("continue_final_message", "other than false")
        for name in ("chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
            if getattr(self, name):
                raise unsupported(name)


class DetokenizeRequest(Request):
    """POST /detokenize: token ids back to text."""

    model: NonEmptyStr | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

    def refuse_unsupported(self) -> None:
        self.refuse_unknown()


def tokenize_body(
    ids: list[int], max_model_len: int, pieces: list[str] | None = None
) -> dict[str, Any]:
    """vLLM's TokenizeResponse; `token_strs` only when asked (else null, as vLLM sends it)."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": pieces}


def detokenize_body(text: str) -> dict[str, Any]:
    return {"prompt": text}
