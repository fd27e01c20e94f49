"""vLLM's own routes beside the OpenAI API: /tokenize, /detokenize, /version, /v1/score and
/v1/rerank. Their request models take vLLM's fields (vllm/entrypoints/openai/protocol.py) and
refuse by name those tokenyard does not implement; their answers have vLLM's shapes."""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import Field

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import unsupported
from tokenyard.gateway.protocol import ChatMessage, Deadline, NonEmptyStr, Request
from tokenyard.messages import JobResult, Priority

# at most this many (query, document) pairs in one score or rerank call: each is an input of
# one job, as an embeddings request's inputs are (OpenAI's bound on those)
MAX_SCORE_PAIRS = 2048


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


# -- score and rerank (cross-encoders) ---------------------------------------------------------


class _Scoring(Request):
    model: NonEmptyStr | None = None
    # vLLM's: -1 keeps the model's own limit; k keeps the last k tokens of each pair
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    additional_data: Any = None
    # vLLM takes an integer (0 only, unless its scheduler orders by priority); tokenyard's
    # lanes take their names, as on the completions routes
    priority: Literal["high", "normal", "low"] | Literal[0] | None = None
    deadline: Deadline | None = None
    cache: bool | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        self.refuse_unknown()
        if self.additional_data is not None:
            raise unsupported("additional_data")
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequest(
                "'truncate_prompt_tokens' must be -1 or at least 1",
                param="truncate_prompt_tokens",
            )

    @property
    def priority_class(self) -> Priority | None:
        if self.priority is None or self.priority == 0:
            return None
        return Priority[self.priority.upper()]

    def pairs(self) -> list[tuple[str, str]]:
        raise NotImplementedError


class ScoreRequest(_Scoring):
    """POST /v1/score (and /score): text_1 against text_2, one to one, one to many or pairwise."""

    text_1: str | Annotated[list[str], Field(min_length=1)]
    text_2: str | Annotated[list[str], Field(min_length=1)]

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequest(
                f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, "
                "or as many as text_2",
                param="text_1",
            )
        return _bounded(list(zip(first, second, strict=True)), "text_2")


class RerankRequest(_Scoring):
    """POST /v1/rerank (and /rerank, /v2/rerank): documents ordered by relevance to a query."""

    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] = 0
    return_documents: bool = True

    def pairs(self) -> list[tuple[str, str]]:
        return _bounded([(self.query, d) for d in self.documents], "documents")


def _bounded(pairs: list[tuple[str, str]], param: str) -> list[tuple[str, str]]:
    if len(pairs) > MAX_SCORE_PAIRS:
        raise InvalidRequest(
            f"{len(pairs)} pairs to score; at most {MAX_SCORE_PAIRS} are allowed", param=param
        )
    return pairs


def scores_of(result: JobResult) -> list[float]:
    """A scoring job's scores, one per pair: each pair's result is one float32 (little-endian),
    the classifier's output after its activation."""
    return [struct.unpack("<f", v[:4])[0] for v in result.embeddings or []]


def score_body(job_id: str, model: str, result: JobResult) -> dict[str, Any]:
    """vLLM's ScoreResponse."""
    tokens = result.prompt_tokens
    return {
        "id": f"score-{job_id}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "score", "score": s} for i, s in enumerate(scores_of(result))
        ],
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }


def rerank_body(job_id: str, model: str, body: RerankRequest, result: JobResult) -> dict[str, Any]:
    """vLLM's RerankResponse (Jina's and Cohere's shape): the documents by descending relevance,
    the first `top_n` of them (0: all)."""
    scores = scores_of(result)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        item["document"] = {"text": body.documents[i]} if body.return_documents else None
        results.append(item)
    return {
        "id": f"rerank-{job_id}",
        "model": model,
        "usage": {"total_tokens": result.prompt_tokens},
        "results": results,
    }
