"""OpenAI's Responses API with the official openai client against a real gateway and sim workers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.gateway.conftest import MODEL, BareSim, Stack, run_stack, slow_engine
from tokenyard.broker import new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import wait_ready
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.messages import StoredResponse, Turn, decode, encode
from tokenyard.tenancy.limiter import Quota
from tokenyard.tenancy.records import TenantConfig

PROMPT = "The yard sorts every car"


def client(stack: Stack, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def slow(valkey: EmbeddedServer) -> Iterator[Stack]:
    """One stack for the module: a sim worker slow enough to catch a response mid-run; the
    gateway sweeps pending stored responses often."""
    with run_stack(valkey, engines=[slow_engine(0.01)], responses_sweep_s=0.1) as s:
        yield s


def _text(events: list[ResponseStreamEvent]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def _done(c: openai.OpenAI, response_id: str, timeout_s: float = 20.0) -> Response:
    give_up = time.monotonic() + timeout_s
    while (r := c.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < give_up, r
        time.sleep(0.02)
    return r


def test_sync_and_stream_agree_with_sequence_numbers(slow: Stack) -> None:
    c = client(slow)
    whole = c.responses.create(
        model=MODEL,
        input=PROMPT,
        instructions="be brief",
        max_output_tokens=12,
        temperature=0.0,
        metadata={"run": "1"},
    )
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete"  # it stopped at max_output_tokens
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert len(whole.output_text) == 12  # the sim tokenizer is byte-level
    assert whole.usage is not None and whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    assert whole.metadata == {"run": "1"} and whole.instructions == "be brief"

    events = list(
        c.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": PROMPT}],
            instructions="be brief",
            max_output_tokens=12,
            temperature=0.0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _text(events) == whole.output_text
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == whole.output_text
    # the stored response answers the same
    again = c.responses.retrieve(last.response.id)
    assert again.output_text == whole.output_text and again.status == "incomplete"


def test_input_item_shape_and_previous_response_id(slow: Stack) -> None:
    c = client(slow)
    first = c.responses.create(
        model=MODEL,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "one "},
                    {"type": "input_text", "text": "two"},
                ],
            }
        ],
        max_output_tokens=6,
        temperature=0.0,
    )
    plain = c.responses.create(model=MODEL, input="one two", max_output_tokens=6, temperature=0.0)
    assert first.output_text == plain.output_text  # the same conversation, the same prompt
    second = c.responses.create(
        model=MODEL,
        input="three",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # the earlier input and output are the context: the prompt grew by them
    explicit = c.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "one two"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "three"},
        ],
        max_output_tokens=6,
        temperature=0.0,
    )
    assert second.usage.input_tokens == explicit.usage.input_tokens  # type: ignore[union-attr]
    assert second.output_text == explicit.output_text


def test_background_poll_stream_resume_cancel_and_delete(slow: Stack) -> None:
    c = client(slow)
    queued = c.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=40, temperature=0.0, background=True
    )
    assert queued.status == "queued" and queued.background
    events: list[ResponseStreamEvent] = []
    for event in c.responses.retrieve(queued.id, stream=True):
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == 8:
            break  # drop the stream midway
    cut = events[-1].sequence_number
    rest = list(c.responses.retrieve(queued.id, stream=True, starting_after=cut))
    assert rest[0].sequence_number == cut + 1
    whole = events + rest
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    done = _done(c, queued.id)
    assert done.status == "incomplete" and _text(whole) == done.output_text
    assert len(done.output_text) == 40
    # a stream resumed past its end ends at once
    assert list(c.responses.retrieve(queued.id, stream=True, starting_after=10_000)) == []

    streamed = list(
        c.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=40, temperature=0.0, background=True,
            stream=True,
        )
    )  # fmt: skip
    assert streamed[0].type == "response.created" and streamed[-1].type == "response.incomplete"
    assert _text(streamed) == done.output_text
    assert c.responses.retrieve(streamed[-1].response.id).output_text == done.output_text

    running = c.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=2000, background=True, temperature=0.0
    )
    for event in c.responses.retrieve(running.id, stream=True):
        if event.type == "response.output_text.delta":
            break  # it runs
    cancelled = c.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(running.id).status == "cancelled"

    c.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(queued.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(queued.id)


def test_store_false_keeps_nothing_and_sync_cannot_be_cancelled(slow: Stack) -> None:
    c = client(slow)
    gone = c.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
    assert gone.status == "incomplete" and len(gone.output_text) == 4
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.create(model=MODEL, input="hi", previous_response_id=gone.id)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    kept = c.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(kept.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        # the sim engine has no structured outputs (the message names it: see below)
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "a", "schema": {"$ref": "#/$defs/x"}}
                }
            },
            "text.format",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        (
            {"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
            "text.format.name",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": 5}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "text", "name": "a"}}}, "text.format.name"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"prompt_cache_key": "k"}, "prompt_cache_key"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input.0.type"),
        # an output that answers no call made earlier in the conversation
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"background": True, "store": False}, "store"),
        ({"previous_response_id": "resp_nothing"}, "previous_response_id"),
    ],
)
def test_refusals_name_the_parameter(slow: Stack, extra: dict[str, object], param: str) -> None:
    with slow.client() as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_json_format_on_an_engine_without_structured_outputs_names_the_engine(
    valkey: EmbeddedServer,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    with run_stack(valkey, engines=[BareSim]) as bare:
        wait_ready(bare.url + "/readyz", timeout_s=60, interval_s=0.05)  # its limits published
        with bare.client() as http:
            r = http.post(
                "/v1/responses", json={"model": MODEL, "input": "hi", "text": {"format": fmt}}
            )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("text.format", "unsupported_parameter")
    assert "bare-sim engine" in error["message"]


def test_neutral_values_of_openai_fields_are_taken(slow: Stack) -> None:
    neutral = {
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "include": [],
        "user": "u1",
        "reasoning": None,
    }
    with slow.client() as http:
        r = http.post(
            "/v1/responses",
            json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **neutral},
        )
    assert r.status_code == 200, r.text
    assert Response.model_validate(r.json()).status == "incomplete"


def test_tenant_scope_quota_and_audit(valkey: EmbeddedServer) -> None:
    """Another tenant's response is 404 on every route; responses count against the tenant's
    quota and are in the audit trail, as every job."""
    keys = KeyRing({"sk-a": Tenant("a"), "sk-b": Tenant("b")})
    with run_stack(valkey, keyring=keys) as stack:
        limited = TenantConfig(name="b", quota=Quota(rpm=1))
        stack.call(stack.gateway_broker.directory.put_tenant(limited))
        a, b = client(stack, "sk-a"), client(stack, "sk-b")
        b.responses.create(model=MODEL, input="x", max_output_tokens=1, background=True)
        with pytest.raises(openai.RateLimitError):
            b.responses.create(model=MODEL, input="x", max_output_tokens=1, background=True)
        mine = a.responses.create(model=MODEL, input="hi", max_output_tokens=4, background=True)
        assert _done(a, mine.id).status == "incomplete"
        for call in (
            lambda: b.responses.retrieve(mine.id),
            lambda: b.responses.cancel(mine.id),
            lambda: b.responses.delete(mine.id),
            lambda: b.responses.create(model=MODEL, input="x", previous_response_id=mine.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert a.responses.retrieve(mine.id).status == "incomplete"
        with httpx.Client(base_url=stack.url) as http:
            assert http.get(f"/v1/responses/{mine.id}").status_code == 401
        _, trail = stack.call(stack.gateway_broker.audit.audit_entries(0.0, tenant="a"))
        job_id = mine.id.removeprefix("resp_")
        assert [(e.event, e.status) for e in trail if e.job_id == job_id] == [
            ("received", "queued"),
            ("terminal", "succeeded"),
        ]


def test_a_response_whose_job_record_lapsed_unseen_reads_failed(slow: Stack) -> None:
    """Its job's record (record_ttl_s) went before any gateway stored the job's result."""
    job_id = new_job_id(MODEL)
    stored = StoredResponse(
        id=f"resp_{job_id}",
        job_id=job_id,
        tenant="default",
        model=MODEL,
        created_at=time.time(),
        context=[Turn("user", "hi")],
        background=True,
    )
    table = slow.gateway_broker.stored_responses
    slow.call(table.put(stored.id, encode(stored), 60, time.time()))
    lapsed = client(slow).responses.retrieve(stored.id)
    assert lapsed.status == "failed" and lapsed.error is not None
    assert "record_ttl_s" in lapsed.error.message


def test_cancel_and_delete_of_queued_background_responses(valkey: EmbeddedServer) -> None:
    """No worker: the jobs wait, so a cancel ends one at once and a delete cancels its job."""
    with run_stack(valkey, engines=[]) as stack:
        c = client(stack)
        waiting = c.responses.create(model=MODEL, input="hi", background=True)
        assert c.responses.retrieve(waiting.id).status == "queued"
        assert c.responses.cancel(waiting.id).status == "cancelled"
        assert c.responses.retrieve(waiting.id).status == "cancelled"
        doomed = c.responses.create(model=MODEL, input="hi", background=True)
        c.responses.delete(doomed.id)
        record = stack.call(stack.gateway_broker.queue.record(doomed.id.removeprefix("resp_")))
        assert record is not None and record.status.value == "cancelled"


def test_a_sweep_stores_what_no_gateway_watched(slow: Stack) -> None:
    """A background response whose creating gateway died before its job ended: the job runs
    on, and any gateway's sweep copies its result into the stored response."""
    with slow.client() as http:
        job = http.post(
            "/v1/jobs",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ).json()
    stored = StoredResponse(
        id=f"resp_{job['id']}",
        job_id=job["id"],
        tenant="default",
        model=MODEL,
        created_at=time.time(),
        context=[Turn("user", "hi")],
        background=True,
    )
    table = slow.gateway_broker.stored_responses
    slow.call(table.put(stored.id, encode(stored), 60, time.time()))  # as the dead gateway left it
    give_up = time.monotonic() + 10
    while (kept := decode(slow.call(table.get(stored.id)), StoredResponse)).result is None:
        assert time.monotonic() < give_up, "no sweep stored the result"
        time.sleep(0.05)
    assert kept.result.completion_tokens == 3
    assert stored.id not in slow.call(table.due(time.time() + 3600, 1000))


@pytest.mark.parametrize("kind", ["valkey", "nats"])
def test_thousands_of_orphans_are_settled_within_two_sweeps(
    request: pytest.FixtureRequest, valkey: EmbeddedServer, kind: str
) -> None:
    """2,000 background responses whose job waits on (no worker) and 500 whose creating gateway
    died and whose job's record is gone: every one of the 500 is settled within about two sweep
    periods, however many pending responses wait beside them (sampling 256 at random per sweep
    took ~60 periods)."""
    url = request.getfixturevalue("nats_server").url if kind == "nats" else None
    with run_stack(valkey, engines=[], broker_url=url, responses_sweep_s=1.0) as stack:
        with stack.client() as http:
            queued = http.post("/v1/jobs", json={"model": MODEL, "prompt": "hi"}).json()["id"]
        table = stack.gateway_broker.stored_responses

        def stored(job_id: str) -> StoredResponse:
            return StoredResponse(
                id=f"resp_{new_job_id(MODEL)}",
                job_id=job_id,
                tenant="default",
                model=MODEL,
                created_at=time.time(),
                context=[Turn("user", "hi")],
                background=True,
            )

        waiting = [stored(queued) for _ in range(2000)]
        orphans = [stored(new_job_id(MODEL)) for _ in range(500)]

        async def put_all() -> None:
            due = time.time()  # as the dead gateway left them, due now
            for one in [*waiting, *orphans]:
                await table.put(one.id, encode(one), 600, due)

        stack.call(put_all(), timeout=120)
        started = time.monotonic()

        async def unsettled() -> int:
            found = [await table.get(o.id) for o in orphans]
            return sum(decode(raw, StoredResponse).result is None for raw in found if raw)

        while left := stack.call(unsettled()):
            assert time.monotonic() - started < 6.0, f"{left} of 500 orphans still pending"
            time.sleep(0.2)
        # the ones whose job waits on are still pending, and read as queued
        kept = decode(stack.call(table.get(waiting[0].id)), StoredResponse)
        assert kept.result is None


def test_a_chain_stores_each_link_once_and_reads_back_the_whole_conversation(
    slow: Stack,
) -> None:
    """40 responses, each continuing the one before: what each link stores (its record and its
    conversation part) does not grow with the chain (a record holding the conversation so far
    stored 40 * 41 / 2 turns in all), the last one's job is given the whole conversation, and
    deleting a record in the middle leaves the chain after it whole."""
    c = client(slow)
    table = slow.gateway_broker.stored_responses

    def stored_bytes(response_id: str) -> int:
        part = getattr(table, "part", None)  # parts beside the records
        record = slow.call(table.get(response_id))
        return len(record) + (len(slow.call(part(response_id)) or b"") if part else 0)

    turns: list[dict[str, str]] = []
    links: list[Response] = []
    for i in range(40):
        said = f"turn {i:02d}"
        link = c.responses.create(
            model=MODEL,
            input=said,
            previous_response_id=links[-1].id if links else None,
            max_output_tokens=2,
            temperature=0.0,
        )
        turns += [
            {"role": "user", "content": said},
            {"role": "assistant", "content": link.output_text},
        ]
        links.append(link)
    sizes = [stored_bytes(link.id) for link in links]
    assert max(sizes[1:]) < 1.3 * sizes[1], sizes  # the 40th stores what the 2nd does

    explicit = c.responses.create(
        model=MODEL, input=[*turns[:-1]], max_output_tokens=2, temperature=0.0
    )
    last = links[-1]
    assert last.usage is not None and explicit.usage is not None
    assert last.usage.input_tokens == explicit.usage.input_tokens
    assert last.output_text == explicit.output_text

    c.responses.delete(links[20].id)
    after = c.responses.create(
        model=MODEL, input="more", previous_response_id=last.id, max_output_tokens=2,
        temperature=0.0,
    )  # fmt: skip
    whole = c.responses.create(
        model=MODEL, input=[*turns, {"role": "user", "content": "more"}], max_output_tokens=2,
        temperature=0.0,
    )  # fmt: skip
    assert after.usage is not None and whole.usage is not None
    assert after.usage.input_tokens == whole.usage.input_tokens
    # a response nothing continues leaves nothing behind when deleted
    c.responses.delete(after.id)
    assert slow.call(table.part(after.id)) is None
