"""vLLM's own routes beside the OpenAI API: /tokenize, /detokenize, /v1/score and /v1/rerank.
Their request models take vLLM's fields (vllm/entrypoints/openai/protocol.py, vllm/entrypoints/
pooling/) and refuse by name those tokenyard does not implement; their answers have vLLM's
shapes."""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import Field

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import unsupported
from tokenyard.gateway.protocol import (
    ChatCompletionRequest,
    ChatTemplateInput,
    Deadline,
    NonEmptyStr,
    Request,
    refuse_no_truncation,
)
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


@runtime_checkable
class TruncatingTokenizer(Protocol):
    """A tokenizer that cuts a prompt as vLLM's `truncate_prompt_tokens` does, keeping its
    special tokens, and encodes text pairs as a cross-encoder reads them (the hf one)."""

    def encode_truncated(self, text: str, keep: int, side: str = "left") -> list[int]: ...

    def encode_pair(
        self, first: str, second: str, keep: int | None = None, side: str | None = None
    ) -> tuple[list[int], int]: ...


class _Tokenize(Request):
    model: NonEmptyStr | None = None
    return_token_strs: bool | None = False


class TokenizeCompletionRequest(_Tokenize):
    """POST /tokenize with a prompt: its token ids as a completion's job would get them."""

    prompt: str
    add_special_tokens: bool = True

    def refuse_unsupported(self) -> None:
        self.refuse_unknown()


class TokenizeChatRequest(ChatTemplateInput, _Tokenize):
    """POST /tokenize with messages: the chat template's prompt, tokenized."""

    add_special_tokens: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        self.refuse_unknown()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        # the template's switches, its variables and a request's own template (where the
        # server trusts them: the route checks) render as a chat completion's; media do not
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            if getattr(self, name):
                raise unsupported(name, "(text only)")

    def as_chat(self, model: str) -> ChatCompletionRequest:
        """The chat completion whose prompt this request tokenizes: its template renders the
        same input, every field of the base both share (messages, tools, switches, variables
        and template), so a field added to that base is carried here too."""
        given = {name: getattr(self, name) for name in ChatTemplateInput.model_fields}
        return ChatCompletionRequest.model_construct(model=model, tool_choice=None, **given)


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
    """What vLLM's score and rerank requests share (its pooling requests' common fields)."""

    model: NonEmptyStr | None = None
    user: str | None = None
    # vLLM's: each pair cut to its last n tokens (-1: the model's context), or first n
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # the classifier's activation (a sigmoid for one label); `softmax` and `activation` are
    # vLLM's deprecated names of it
    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's request id names its log lines; the answer's id is the job's here
    request_id: str | None = None
    # salts vLLM's prefix cache; an encoder's passes share none, so there is nothing to salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    # vLLM takes an integer (0 only, unless its scheduler orders by priority); tokenyard's
    # lanes take their names, as on the completions routes
    priority: Literal["high", "normal", "low"] | Literal[0] | None = None
    deadline: Deadline | None = None
    cache: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field this server does not implement."""
        self.refuse_unknown()
        refuse_no_truncation(self.truncate_prompt_tokens)
        if self.mm_processor_kwargs is not None:
            raise unsupported("mm_processor_kwargs", "(text pairs only)")
        if self.padding == "max_length":
            raise unsupported("padding", "other than do_not_pad")
        given = {v for v in (self.use_activation, self.softmax, self.activation) if v is not None}
        if len(given) > 1:
            raise InvalidRequest(
                "'use_activation' (and its old names 'softmax', 'activation') disagree",
                param="use_activation",
            )

    @property
    def activated(self) -> bool:
        """Whether scores go through the classifier's activation (vLLM's default: yes)."""
        for value in (self.use_activation, self.softmax, self.activation):
            if value is not None:
                return value
        return True

    @property
    def side(self) -> str | None:
        """Where a pair is cut: None (not given) leaves it to the tokenizer's own pair
        truncation, as vLLM does; given, the pair's tokens are sliced on that side."""
        return self.truncation_side

    @property
    def priority_class(self) -> Priority | None:
        if self.priority is None or self.priority == 0:
            return None
        return Priority[self.priority.upper()]

    def pairs(self) -> tuple[list[tuple[str, str]], str]:
        """The (query, document) pairs to score, and the field naming the documents."""
        raise NotImplementedError


Texts = str | Annotated[list[str], Field(min_length=1)]
_SCORE_FIELDS = (
    ("text_1", "text_2"),
    ("data_1", "data_2"),
    ("queries", "documents"),
    ("queries", "items"),
)


class ScoreRequest(_Scoring):
    """POST /v1/score (and /score): each first text against the second ones, one to one, one
    to many, or pairwise; vLLM's names for the two: text_1 and text_2, data_1 and data_2,
    queries and documents or items."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    def pairs(self) -> tuple[list[tuple[str, str]], str]:
        asked = tuple(
            name
            for name in ("text_1", "data_1", "queries", "text_2", "data_2", "documents", "items")
            if getattr(self, name) is not None
        )
        if asked not in _SCORE_FIELDS:
            raise InvalidRequest(
                "give one pair of fields to score: text_1 and text_2, data_1 and data_2, or "
                "queries and documents (or items)",
                param=asked[0] if asked else "text_1",
            )
        a, b = asked
        first, second = getattr(self, a), getattr(self, b)
        firsts = [first] if isinstance(first, str) else first
        seconds = [second] if isinstance(second, str) else second
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidRequest("Input lengths must be either 1:1, 1:N or N:N", param=a)
        return _bounded(list(zip(firsts, seconds, strict=True)), b), b


class RerankRequest(_Scoring):
    """POST /v1/rerank (and /rerank, /v2/rerank): documents ordered by relevance to a query,
    Jina's and Cohere's API as vLLM serves it."""

    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: int = 0  # the first n by relevance; 0 or less: all
    return_documents: bool = True  # Jina's and Cohere's: false leaves each `document` out

    def pairs(self) -> tuple[list[tuple[str, str]], str]:
        return _bounded([(self.query, d) for d in self.documents], "documents"), "documents"


def _bounded(pairs: list[tuple[str, str]], param: str) -> list[tuple[str, str]]:
    if len(pairs) > MAX_SCORE_PAIRS:
        raise InvalidRequest(
            f"{len(pairs)} pairs to score; at most {MAX_SCORE_PAIRS} are allowed", param=param
        )
    return pairs


def scores_of(result: JobResult) -> list[float]:
    """A scoring job's scores, one per pair: each pair's output is one float32 (little-endian),
    the classifier's logit after its activation."""
    return [struct.unpack("<f", v[:4])[0] for v in result.embeddings or []]


def score_body(job_id: str, model: str, result: JobResult) -> dict[str, Any]:
    """vLLM's ScoreResponse."""
    tokens = result.prompt_tokens
    scores = scores_of(result)
    return {
        "id": f"score-{job_id}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }


def rerank_body(job_id: str, model: str, body: RerankRequest, result: JobResult) -> dict[str, Any]:
    """vLLM's RerankResponse (Jina's and Cohere's shape): the documents by descending relevance,
    the first `top_n` of them (0 or less: all)."""
    scores = scores_of(result)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n > 0:
        order = order[: body.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": body.documents[i], "multi_modal": None}
        results.append(item)
    tokens = result.prompt_tokens
    return {
        "id": f"rerank-{job_id}",
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
