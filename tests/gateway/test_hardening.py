"""Hostile input over real HTTP (issue 28): out-of-range values, bodies that are not UTF-8 or
nest too deep, bad resume points and oversize bodies each get an OpenAI-shaped 4xx, and one
client's bad request never fails another's."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Message, Receive, Scope, Send

from tests.gateway.conftest import MODEL, Stack, run_stack
from tests.gateway.test_errors import assert_error
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.gateway.limits import BodyLimitMiddleware
from tokenyard.messages import Priority

OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/jobs", "/v1/batches")
TENANTS = ("acme", "globex", "initech")
BAD_SEEDS = (2**64, 2**64 - 1, 2**63, -(2**63) - 1)


@pytest.fixture(scope="module")
def shared(valkey: EmbeddedServer) -> Iterator[Stack]:
    """One stack for the module (each test's jobs are its own), with a key per tenant."""
    keyring = KeyRing({f"sk-{t}": Tenant(t, Priority.NORMAL) for t in TENANTS})
    with run_stack(valkey, keyring=keyring) as stack:
        yield stack


@pytest.fixture(scope="module")
def http(shared: Stack) -> Iterator[httpx.Client]:
    with shared.client() as client:
        yield client


def key(tenant: str = TENANTS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{tenant}"}


def post(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json", **key()})


@pytest.mark.parametrize("seed", BAD_SEEDS)
@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", OK), ("/v1/chat/completions", CHAT), ("/v1/jobs", OK)]
)
def test_a_seed_past_signed_64_bits_is_400(
    http: httpx.Client, path: str, body: dict[str, Any], seed: int
) -> None:
    response = post(http, path, json.dumps({**body, "seed": seed}).encode())
    error = assert_error(response, 400, "invalid_value")
    assert error["param"] == "seed"
    assert error["type"] == "invalid_request_error"
    assert "signed 64-bit integer" in error["message"]


def test_the_edges_of_the_seed_range_are_served(shared: Stack) -> None:
    client = openai.OpenAI(base_url=shared.url + "/v1", api_key="sk-acme", max_retries=0)
    for seed in (2**63 - 1, -(2**63)):
        done = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=seed)
        assert done.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=2**64
        )
    assert refused.value.status_code == 400
    assert refused.value.param == "seed"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (json.dumps({**OK, "top_k": 2**64}).encode(), "top_k"),
        (b'{"model": "sim-model", "prompt": "hi", "deadline": 1e400}', "deadline"),  # inf
    ],
)
def test_other_values_out_of_range_are_400(http: httpx.Client, content: bytes, param: str) -> None:
    assert (
        assert_error(post(http, "/v1/completions", content), 400, "invalid_value")["param"] == param
    )


async def test_bad_seeds_among_valid_jobs_of_other_tenants_fail_only_themselves(
    shared: Stack,
) -> None:
    async with httpx.AsyncClient(base_url=shared.url, timeout=30.0) as http:

        async def submit(i: int, bad: bool) -> tuple[bool, int]:
            body = {**OK, "seed": 2**64 + i} if bad else {**OK, "seed": i}
            tenant = TENANTS[i % len(TENANTS)]
            response = await http.post("/v1/jobs", json=body, headers=key(tenant))
            return bad, response.status_code

        for _ in range(2):  # rounds: each a burst of 60 valid and 3 bad jobs
            calls = [submit(i, bad=i % 21 == 7) for i in range(63)]
            answers = await asyncio.gather(*calls)
            assert sorted(s for bad, s in answers if not bad) == [202] * 60
            assert [s for bad, s in answers if bad] == [400] * 3


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + close * depth).encode()


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize(
    "content",
    [
        nested(5000),
        ('{"a":' * 5000 + "1" + "}" * 5000).encode(),
        # deep inside a valid request
        json.dumps({**OK, "user": "u"}).encode()[:-1] + b', "metadata": ' + nested(3000) + b"}",
    ],
    ids=["arrays", "objects", "inside-a-request"],
)
def test_a_body_nested_thousands_deep_is_400(http: httpx.Client, path: str, content: bytes) -> None:
    error = assert_error(post(http, path, content), 400, "json_too_deep")
    assert error["type"] == "invalid_request_error"
    assert "nest" in error["message"]


def test_brackets_inside_strings_do_not_count_as_nesting(http: httpx.Client) -> None:
    prompt = '[{"x": "\\"[[[' * 200
    response = post(http, "/v1/jobs", json.dumps({**OK, "prompt": prompt}).encode())
    assert response.status_code == 202, response.text


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "sim-model", "prompt": "caf\xe9", "max_tokens": 2}',
        b'{"model": "sim-model", "prompt": "\xff\xfe", "max_tokens": 2}',
        b'{"model": "sim-model", "prompt": "x", "max_tokens": 2, "user": "\xed\xa0\x80"}',
        b'\xff{"model": "sim-model"}',
    ],
)
def test_a_body_that_is_not_utf8_is_400(http: httpx.Client, path: str, content: bytes) -> None:
    error = assert_error(post(http, path, content), 400, "invalid_json")
    assert error["type"] == "invalid_request_error"
    assert "UTF-8" in error["message"]


def chunks(body: bytes, size: int = 64 << 10) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


@pytest.mark.parametrize("megabytes", [2, 3])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/jobs", "/v1/batches"])
def test_a_body_of_megabytes_is_413_json(
    shared: Stack, http: httpx.Client, path: str, chunked: bool, megabytes: int
) -> None:
    big = json.dumps({**OK, "prompt": "x" * (megabytes << 20)}).encode()
    status, body = raw_post(shared.url, path, big, chunked=chunked)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error"
    # httpx reads the answer while it sends; the connection is reused
    content: Any = chunks(big) if chunked else big
    assert_error(http.post(path, content=content, headers=key()), 413, "request_too_large")
    assert http.post("/v1/jobs", json=OK, headers=key()).status_code == 202


HUGE_DIGITS = "9" * 5000  # int() refuses more than 4,300 digits with a ValueError


@pytest.mark.parametrize("resume", [HUGE_DIGITS, f"1-{HUGE_DIGITS}", f"{HUGE_DIGITS}-1"])
def test_a_resume_point_of_thousands_of_digits_is_400(
    http: httpx.Client, finished_job: str, resume: str
) -> None:
    for job_id in (finished_job, f"cmpl-{finished_job}"):
        path = f"/v1/jobs/{job_id}/events"
        refused = http.get(path, headers={**key(), "Last-Event-ID": resume})
        assert assert_error(refused, 400, "invalid_value")["param"] == "Last-Event-ID"
        refused = http.get(path, params={"after": resume}, headers=key())
        assert assert_error(refused, 400, "invalid_value")["param"].endswith("after")


def test_a_response_resumed_after_thousands_of_digits_is_400(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    done = http.post("/v1/responses", json=body, headers=key())
    assert done.status_code == 200, done.text
    refused = http.get(
        f"/v1/responses/{done.json()['id']}",
        params={"stream": "true", "starting_after": HUGE_DIGITS},
        headers=key(),
    )
    assert assert_error(refused, 400, "invalid_value")["param"].endswith("starting_after")


async def test_a_content_length_of_thousands_of_digits_is_413() -> None:
    """The servers the CLI runs refuse such a header first; the limit does not rely on it."""
    reached: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(scope)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-length", HUGE_DIGITS.encode()), (b"content-type", b"application/json")]
    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/jobs", "headers": headers}
    await BodyLimitMiddleware(app, 1 << 20)(scope, receive, send)
    assert not reached
    assert sent[0]["status"] == 413
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["code"] == "request_too_large"


def raw_post(url: str, path: str, body: bytes, *, chunked: bool) -> tuple[int, dict[str, Any]]:
    """POST over a bare socket that sends its whole body before it reads the answer, as a
    client that writes from one thread and reads from another would."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    head += "authorization: Bearer sk-acme\r\n"
    if chunked:
        framed = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks(body)) + b"0\r\n\r\n"
        payload = (head + "transfer-encoding: chunked\r\n\r\n").encode() + framed
    else:
        payload = (head + f"content-length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
    head_bytes, _, rest = answer.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    lines = head_bytes.decode().lower().split("\r\n")
    if "transfer-encoding: chunked" in lines:
        size, _, rest = rest.partition(b"\r\n")
        rest = rest[: int(size, 16)]
    return status, json.loads(rest)


def test_concurrent_clients_sending_oversize_bodies_all_get_their_413(
    shared: Stack, http: httpx.Client
) -> None:
    big = json.dumps({**OK, "prompt": "x" * (3 << 20)}).encode()
    answers: list[tuple[int, dict[str, Any]] | BaseException] = []

    def one(chunked: bool) -> None:
        try:
            answers.append(raw_post(shared.url, "/v1/completions", big, chunked=chunked))
        except BaseException as exc:  # a reset lands here
            answers.append(exc)

    threads = [threading.Thread(target=one, args=(i % 2 == 1,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 6
    for answer in answers:
        assert not isinstance(answer, BaseException), repr(answer)
        status, body = answer
        assert status == 413
        assert body["error"]["code"] == "request_too_large"
    # the gateway still serves
    assert http.post("/v1/jobs", json=OK, headers=key()).status_code == 202


BAD_RESUME_POINTS = [
    "18446744073709551616",  # 2^64
    "1-18446744073709551616",
    "99999999999999999999999999-0",
    "1-99999999999999999999999999",
    "\u0661\u0662\u0663",  # Arabic-Indic digits: str.isdigit() says yes
    "1-\u0663",
    "\uff11-0",  # a fullwidth digit
    "\u00b2",  # superscript two: one byte in Latin-1, as header values are read
]


def _header_bytes(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode()


@pytest.fixture(scope="module")
def finished_job(http: httpx.Client) -> str:
    job = http.post("/v1/jobs", json=OK, headers=key()).json()
    with http.stream("GET", f"/v1/jobs/{job['id']}/events", headers=key()) as events:
        for _ in events.iter_lines():
            pass
    return str(job["id"])


@pytest.mark.parametrize("resume", BAD_RESUME_POINTS)
def test_a_resume_point_out_of_range_is_400_before_the_stream(
    http: httpx.Client, finished_job: str, resume: str
) -> None:
    job = finished_job
    ids = [job, f"cmpl-{job}"]  # the job's own events, and a completion's resume
    for job_id in ids:
        path = f"/v1/jobs/{job_id}/events"
        header = {"Last-Event-ID": _header_bytes(resume)}
        for response, param in (
            (http.get(path, headers={**key(), **header}), "Last-Event-ID"),
            (http.get(path, params={"after": resume}, headers=key()), "after"),
        ):
            error = assert_error(response, 400, "invalid_value")
            assert error["param"] == param
            assert error["type"] == "invalid_request_error"


def test_the_largest_resume_point_is_no_error(http: httpx.Client, finished_job: str) -> None:
    last = f"{2**64 - 1}-{2**64 - 1}"
    for job_id in (finished_job, f"cmpl-{finished_job}"):
        ok = http.get(f"/v1/jobs/{job_id}/events", params={"after": last}, headers=key())
        assert ok.status_code == 200, ok.text
        assert "error" not in ok.text
