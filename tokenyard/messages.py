"""Wire types: every Struct that crosses a process boundary, encoded as versioned msgpack."""

from __future__ import annotations

import enum
from typing import Any, TypeVar

import msgspec

from tokenyard.errors import InvalidRequest

WIRE_VERSION = 1


class Priority(enum.IntEnum):
    """Lane priority class; a lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2
    BATCH = 3  # offline batches (/v1/batches): below every interactive lane, never starved


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DEAD = "dead"

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    ERROR = "error"


class Feature(enum.StrEnum):
    """Optional decoding features; each engine declares those it implements (workers publish
    them in `ModelLimits.features`) and a request needing another is refused at admission."""

    PENALTIES = "penalties"  # presence_penalty, frequency_penalty, repetition_penalty
    LOGIT_BIAS = "logit_bias"
    MIN_TOKENS = "min_tokens"
    STOP_TOKEN_IDS = "stop_token_ids"
    LOGPROBS = "logprobs"  # logprobs / top_logprobs
    STRUCTURED_OUTPUTS = "structured_outputs"  # response_format, structured_outputs, tools
    # vLLM's extensions; a worker that predates one does not publish it, so a request using
    # it is refused (naming the field) until every worker of the model knows it
    MIN_P = "min_p"
    ALLOWED_TOKEN_IDS = "allowed_token_ids"
    BAD_WORDS = "bad_words"
    DETOKENIZE = "detokenize"  # the skip_special_tokens / spaces_between / stop str switches
    CACHE_SALT = "cache_salt"
    PROMPT_LOGPROBS = "prompt_logprobs"


class Guide(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A constraint on what may be generated (structured outputs), compiled by xgrammar.

    Exactly one field is set, as in vLLM's `StructuredOutputsParams`: a JSON schema (as JSON
    text, so it hashes and crosses the wire as one value), any JSON object, a regex, one of
    fixed strings, or an EBNF grammar in xgrammar's dialect.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @property
    def field(self) -> tuple[str, Any]:
        """The one field set, as (name, value): ("json", the schema's text), ("json_object",
        True), ("regex", text), ("choice", the strings) or ("grammar", EBNF text).
        InvalidRequest (param response_format) unless exactly one is set."""
        set_fields = [
            (name, value)
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(set_fields) != 1:
            raise InvalidRequest(
                f"a structured output needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {[name for name, _ in set_fields] or 'none'}",
                param="response_format",
            )
        return set_fields[0]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to decode; top_k == 0, top_p == 1.0 and min_p == 0.0 disable those filters.

    Penalties follow vLLM's formulas (OpenAI's presence/frequency over the generated tokens,
    the CTRL repetition penalty over prompt and output); `logit_bias` holds (token id, bias)
    pairs sorted by id; `logprobs` asks for each chosen token's log-probability and that many
    of the most likely alternatives (None: no logprobs). vLLM's extensions mean what they mean
    there: `allowed_token_ids` (sorted, distinct; empty: all) and `bad_words` (text, masked as
    token sequences the engine's tokenizer makes of them) mask tokens; the detokenization
    switches shape the text only; `cache_salt` keeps prefix caches apart (no prompt's cached
    KV is shared across salts) and, hashed with these params, the response cache too."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    guide: Guide | None = None
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many likeliest

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def depends_on_output(self) -> bool:
        """Decoding depends on the tokens generated so far (a guide's state, presence and
        frequency penalties, bad words of several tokens): resumed tokens must count as
        output, not as more prompt."""
        return (
            self.guide is not None
            or bool(self.presence_penalty or self.frequency_penalty)
            or bool(self.bad_words)
        )

    @property
    def detokenizes_plainly(self) -> bool:
        """Text is decoded as by default (special tokens skipped, stop strings left out)."""
        return (
            self.skip_special_tokens
            and self.spaces_between_special_tokens
            and not self.include_stop_str_in_output
        )

    def min_tokens_left(self, resumed: int) -> int:
        """min_tokens still owed after `resumed` tokens an earlier attempt generated."""
        return max(0, self.min_tokens - resumed)

    @property
    def features(self) -> frozenset[Feature]:
        """What of an engine's optional features decoding with these params needs."""
        wanted: set[Feature] = set()
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            wanted.add(Feature.PENALTIES)
        if self.logit_bias:
            wanted.add(Feature.LOGIT_BIAS)
        if self.min_tokens:
            wanted.add(Feature.MIN_TOKENS)
        if self.stop_token_ids:
            wanted.add(Feature.STOP_TOKEN_IDS)
        if self.logprobs is not None:
            wanted.add(Feature.LOGPROBS)
        if self.guide is not None:
            wanted.add(Feature.STRUCTURED_OUTPUTS)
        if self.min_p:
            wanted.add(Feature.MIN_P)
        if self.allowed_token_ids:
            wanted.add(Feature.ALLOWED_TOKEN_IDS)
        if self.bad_words:
            wanted.add(Feature.BAD_WORDS)
        if not self.detokenizes_plainly:
            wanted.add(Feature.DETOKENIZE)
        if self.cache_salt is not None:
            wanted.add(Feature.CACHE_SALT)
        if self.prompt_logprobs is not None:
            wanted.add(Feature.PROMPT_LOGPROBS)
        return frozenset(wanted)


class CallReading(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a chat job's answer is read for tool calls, set at admission when its request
    offered tools (and did not say `tool_choice` none). Every reader of the job builds its
    parser from this alone: the live call, the jobs API's stream (resumed or not), a batch's
    output. The tools themselves are not kept: they shaped the prompt and any guide already,
    and reading needs only the format."""

    parser: str  # hermes, llama3_json or mistral; `required`; `named` (tool_choice's function)
    function: str | None = None  # the function `tool_choice` names (parser `named`)
    parallel: bool = True  # parallel_tool_calls false: only the first call is kept


class ReasoningReading(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a chat job's answer is split into reasoning and content, set at admission when the
    gateway has a reasoning parser (vLLM's `--reasoning-parser`) and the prompt leaves the
    model thinking. Kept with the job, like `CallReading`, so every reader of it (the live
    call, the jobs API's stream resumed or not, a batch's output) splits it alike."""

    parser: str  # deepseek_r1 or qwen3
    include: bool = True  # the request's `include_reasoning`: false drops the reasoning


class PoolingOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How an embeddings or scoring job's inputs become its outputs (vLLM's PoolingParams),
    set at admission from the request and kept with the job, so every engine and every
    attempt makes the same outputs of it."""

    # each input is a (query, document) pair a cross-encoder scores: its output is one float
    score: bool = False
    # embeddings: the first n values of each vector (a matryoshka model's), taken before
    # normalising, as vLLM does
    dimensions: int | None = None
    normalize: bool | None = None  # embeddings: L2-normalise; None: the model's own default
    activation: bool = True  # scores: the classifier's activation (vLLM's use_activation)
    # scores: where each pair's second text starts (its token type 1), one per input
    second: tuple[int, ...] = ()


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One generated token's log-probability under the model (before any penalty, bias or
    temperature, as vLLM's default `raw_logprobs`), and the `SamplingParams.logprobs` most
    likely tokens at that position as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class PromptLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One prompt token's log-probability given the tokens before it (vLLM's
    `prompt_logprobs`: the model's raw distribution), its rank there (1: the most likely),
    and the `SamplingParams.prompt_logprobs` most likely tokens as (token id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class JobSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A unit of work as enqueued; `attempt` counts earlier deliveries of this job.

    Fields at their defaults are left out on the wire (so is `v` while it is WIRE_VERSION: a
    spec without it is of version 1): every script copies a job's spec and every worker decodes
    it, and a plain job's spec is ~80 bytes, not ~700."""

    v: int = WIRE_VERSION
    id: str
    model: str
    tenant: str = "default"
    priority: Priority = Priority.NORMAL
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    deadline: float | None = None  # unix seconds; past it the job ends `expired`
    idempotency_key: str | None = None
    # an identical deterministic request in flight with this key is joined, not run again
    collapse_key: str | None = None
    trace_context: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float = 0.0
    # Someone follows the tokens as they come (SSE, the jobs API). A sync call reads only the
    # result, so its worker writes no token events: a crash then regenerates, same output.
    stream: bool = True
    # the tenant's quota holds a reservation for this job: its terminal state settles it
    quota: bool = False
    weight: float = 1.0  # the tenant's share of its lane, against other tenants' weights
    attempt: int = 0
    pool: int = 0  # size pool (set by the broker at enqueue from prompt + max_tokens)
    # prefix affinity: hash of the prompt's first blocks (tokenyard.gateway.affinity.prefix_key); a
    # job with one prefers the worker that last ran that prefix, for a bounded wait
    prefix_key: str = ""
    # an embeddings job (/v1/embeddings): `prompt_token_ids` holds its inputs one after another,
    # of these lengths; its result carries one vector per input and no tokens
    input_lengths: list[int] | None = None
    # a chat job whose request offered tools: how its answer is read for calls (None: the
    # answer is all content; so are jobs recorded before this field existed)
    calls: CallReading | None = None
    # a chat job read with a reasoning parser: how its answer splits into reasoning and
    # content (None: no reasoning is read out of it)
    reasoning: ReasoningReading | None = None
    # an embeddings or scoring job's options (None: an embeddings job as the model pools)
    pooling: PoolingOptions | None = None
    # a LoRA adapter the base `model` runs with ("": the base alone; so are jobs recorded
    # before this field existed), and where a worker that was not given it loads it from
    adapter: str = ""
    adapter_path: str = ""


class AdapterRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA adapter served as a model of its own name: the base model it runs on, and where
    workers load it from (a PEFT adapter directory or hub id). Kept in the broker's directory
    (`Directory.put_adapter`) so every gateway lists and routes it and every worker of the
    base can load it."""

    name: str
    base: str
    path: str
    created_at: float = 0.0


class TokenChunk(msgspec.Struct, tag="tokens", kw_only=True):
    """Tokens produced by one engine step for one job; `logprobs`, when the job asked for
    them, has one entry per token id."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


class JobResult(msgspec.Struct, kw_only=True):
    """The terminal outcome of a job, written once."""

    v: int = WIRE_VERSION
    status: JobStatus
    finish_reason: FinishReason | None = None
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    worker: str | None = None
    queued_s: float | None = None  # enqueue to the start of the delivery that finished it
    attempt: int = 0  # earlier deliveries of the job (retries, redeliveries) before that one
    # first to last token of that delivery: a reader that saw no token events times with it
    decode_s: float | None = None
    # an embeddings job's vectors, one per input: float32, little-endian (OpenAI's base64 bytes)
    embeddings: list[bytes] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the job asked
    # prompt tokens the engine found in its prefix cache (usage.prompt_tokens_details
    # .cached_tokens); None: its engine does not say
    cached_tokens: int | None = None
    # the prompt's tokens after its first (which has none), when the job asked
    prompt_logprobs: list[PromptLogprob] | None = None


class Finished(msgspec.Struct, tag="finish", kw_only=True):
    """Last event of a job's stream; carries the terminal result."""

    result: JobResult


JobEvent = TokenChunk | Finished


class JobRecordBase(msgspec.Struct, kw_only=True):
    """A job's spec and state as every backend's record holds them: `JobRecord` is what
    callers read, a backend's own record (NATS's `StoredJob`) adds its bookkeeping."""

    spec: JobSpec
    status: JobStatus
    deliveries: int = 0
    enqueued_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None  # the consumer holding (or that last held) its lease
    last_error: str | None = None


class JobRecord(JobRecordBase, kw_only=True):
    """What the broker knows about a job: its spec, state and, once terminal, its result.

    Its lane is the spec's (model, priority).
    """

    cancel_requested: bool = False
    result: JobResult | None = None
    preemptions: int = 0  # times it was handed back for higher-priority work (resumed after)


class DeadLetter(msgspec.Struct, kw_only=True):
    """An entry of the dead-letter stream."""

    job_id: str
    model: str
    priority: Priority
    reason: str
    error: str | None
    deliveries: int
    at: float


class ModelLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker's engine can take; published in its heartbeat (see `tokenyard.limits`)."""

    max_model_len: int  # context: prompt + generated tokens of one sequence
    max_seqs: int  # sequences running at once
    token_budget: int  # prompt + max_tokens reserved over all running sequences
    vocab_size: int = 0  # token ids must be below it; 0: not known
    revision: str = ""  # what identifies the weights (response cache key); "": not known
    generates: bool = True  # runs completions (an embedding-only model does not)
    embeds: bool = False  # runs embeddings jobs
    scores: bool = False  # runs scoring jobs: a cross-encoder (/v1/score, /v1/rerank)
    adapters: bool = False  # runs LoRA adapters (a worker that predates this field: none)
    # embeddings may be shortened (`dimensions`): a matryoshka model (its config's
    # `is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them)
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()  # the sizes it allows; (): any
    engine: str = ""  # the engine's name, for a refusal to name it
    # the optional decoding features it implements (`Feature` values; strings, so a gateway
    # reads a newer worker's heartbeat whose features it does not know yet)
    features: frozenset[str] = frozenset()

    @property
    def context(self) -> int:
        """The longest single sequence: the context, or the whole budget when that is smaller."""
        return min(self.max_model_len, self.token_budget)


class WorkerInfo(msgspec.Struct, kw_only=True):
    """A worker's heartbeat: who it is and how busy it is."""

    v: int = WIRE_VERSION
    consumer: str
    model: str
    engine: str
    host: str
    pid: int
    started_at: float
    state: str = "running"  # running | draining
    slots_total: int = 0
    slots_used: int = 0
    tokens_per_s: float = 0.0
    mean_batch: float = 0.0
    jobs_done: int = 0
    busy_s: float = 0.0  # slot-seconds its running jobs have held since it started
    limits: ModelLimits | None = None
    at: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_T = TypeVar("_T")


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decode(data: bytes, kind: type[_T]) -> _T:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    result: _T = decoder.decode(data)
    return result


_event_decoder: msgspec.msgpack.Decoder[JobEvent] = msgspec.msgpack.Decoder(JobEvent)


def decode_event(data: bytes) -> JobEvent:
    return _event_decoder.decode(data)


# -- batches (OpenAI's Batch API): the record the broker keeps for the batch runner --------


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (
            BatchStatus.FAILED,
            BatchStatus.COMPLETED,
            BatchStatus.EXPIRED,
            BatchStatus.CANCELLED,
        )


class LineError(msgspec.Struct, kw_only=True):
    """One of a batch's validation errors; `line` is 1-based, as OpenAI reports it."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(msgspec.Struct, kw_only=True):
    """A batch as the runner drives it. The request outcomes live beside it (see BatchStore)."""

    v: int = WIRE_VERSION
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = BatchStatus.VALIDATING
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[LineError] = msgspec.field(default_factory=list)
    total: int = 0
    submitted: int = 0  # lines 0..submitted-1 have a job (or an admission error)
    metadata: dict[str, str] | None = None
    model: str | None = None
    prompt_tokens: int = 0  # of the requests counted so far (a progress figure)
    completion_tokens: int = 0


# -- engines: counters an engine reports (from its own process, for engines/process.py) ---


class EngineStats(msgspec.Struct):
    """Counters since start, and gauges of the moment; mean_batch is sequences per step."""

    steps: int = 0
    sequences_stepped: int = 0
    tokens_generated: int = 0  # decode tokens
    running: int = 0  # sequences added and not finished
    waiting: int = 0  # of those, not yet in a running batch (hf-static's next batch)
    reserved_tokens: int = 0  # prompt + max_tokens over running sequences
    prefill_tokens: int = 0  # prompt (and resumed) tokens of every started sequence
    kv_cache_usage: float = 0.0  # fraction of the KV cache in use (hf), 0 where unknown
    # prompt tokens looked up in / found in the engine's prefix cache (sim; 0 where unknown)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def mean_batch(self) -> float:
        return self.sequences_stepped / self.steps if self.steps else 0.0


# -- stored responses (OpenAI's Responses API): what the broker keeps of one response ------


class Turn(msgspec.Struct, array_like=True, frozen=True):
    """One message of a conversation as the chat template takes it."""

    role: str  # system | user | assistant, or function_call | function_call_output
    content: str  # the text; a function call's or its output's item as JSON


class ConversationPart(msgspec.Struct, kw_only=True):
    """What one stored response added to the conversation (its predecessor's output, then its
    own input), kept beside the record for the responses chained after it: a conversation is
    its parts, walked back through `previous`, so a chain is stored once, not once per link."""

    previous: str | None  # the response whose part comes before (None: this one starts it)
    turns: list[Turn]
    depth: int  # parts in the walk back from this one, this one included
    kept_until: float  # when it lapses (unix seconds): a later link keeps it at least as long
    continued: bool = False  # a response was chained after it: deleting its record keeps it


class StoredResponse(msgspec.Struct, kw_only=True):
    """A response of /v1/responses: its request, its job, and once seen its job's result.

    `context` is what it added to the conversation (its `ConversationPart`'s turns) when
    `chained`; in a record stored before parts it is the whole conversation its job was given.
    """

    v: int = WIRE_VERSION
    id: str  # "resp_" + the job id
    job_id: str
    tenant: str
    model: str
    created_at: float
    context: list[Turn]
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    background: bool = False
    store: bool = True
    result: JobResult | None = None  # the job's terminal result, once a gateway saw it
    completed_at: float | None = None
    # its function tools, tool_choice and parallel_tool_calls (JSON, as the request gave
    # them), shown with it; None: it had none
    tools: str | None = None
    # its `text.format` (JSON, as the request gave it; None: plain text), shown when read
    text_format: str | None = None
    # how its output is read for calls: its job's `JobSpec.calls`, as admission decided it,
    # so a reading does not hang on the gateway's settings now. None: not read for calls, or
    # stored before responses kept it (decided again from `tools` then)
    calls: CallReading | None = None
    # how its output's reasoning is split off: its job's `JobSpec.reasoning` (None: not
    # read for reasoning, or stored before responses kept it: all content then)
    reasoning: ReasoningReading | None = None
    # its context is its part only: the conversation before it is in the parts it refers back
    # to (False: a record stored before parts, whose context is the whole conversation)
    chained: bool = False
    # the LoRA adapter its job runs with: the model the response names ("": `model`)
    adapter: str = ""
