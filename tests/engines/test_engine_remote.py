"""The remote engine against a real upstream: a second tokenyard (gateway + HF worker)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("transformers")

from tests.engines.conformance import (
    CASE_IDS,
    CASES,
    SLOTS,
    Reference,
    Subject,
    greedy,
    hf_reference,
    run_one,
)
from tests.engines.upstream import CuttingProxy, tokenyard_serve
from tokenyard.engines import make_engine
from tokenyard.engines.remote import RemoteEngine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.fleet.launch import free_port
from tokenyard.messages import FinishReason

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with tokenyard_serve(tmp_path_factory.mktemp("upstream") / "valkey") as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> Reference:
    return hf_reference(ensure_tiny_model())


def remote(url: str, **kw: object) -> RemoteEngine:
    engine = make_engine("remote", model="tiny", url=url, concurrency=SLOTS, **kw)
    assert isinstance(engine, RemoteEngine)
    return engine


@pytest.fixture
async def subject(upstream: str, reference: Reference) -> AsyncIterator[Subject]:
    engine = remote(upstream)
    await engine.start()
    yield Subject(engine, reference)
    await engine.stop()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_conformance(subject: Subject, case: object) -> None:
    await case(subject)  # type: ignore[operator]


async def test_upstream_refusal_fails_the_sequence_with_its_message(upstream: str) -> None:
    # This engine believes in a longer context than the upstream has: the upstream says 400.
    engine = remote(upstream, max_model_len=100_000)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("hello")
        r = await run_one(Subject(engine, None), "big", prompt, greedy(3000))  # type: ignore[arg-type]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.ERROR
        assert r.finish.error is not None
        assert "HTTP 400" in r.finish.error and "maximum context length" in r.finish.error
        assert r.finish.refused  # the job fails without a retry
        r = await run_one(Subject(engine, None), "fine", prompt, greedy(3))  # type: ignore[arg-type]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
    finally:
        await engine.stop()


async def test_dropped_stream_is_retried_from_the_streamed_tokens(
    upstream: str, reference: Reference
) -> None:
    port = urlparse(upstream).port
    assert port is not None
    proxy = CuttingProxy(port, cuts=2, after=1500)
    engine = remote(await proxy.start(), backoff_s=0.05)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("Once upon a time")
        r = await run_one(Subject(engine, reference), "cut", prompt, greedy(40))
        assert proxy.connections == 3
        assert r.token_ids == await reference(prompt, 40)
        assert r.finish is not None and r.finish.completion_tokens == 40
    finally:
        await engine.stop()
        await proxy.close()


async def test_unreachable_upstream_fails_after_retries(tmp_path: Path) -> None:
    engine = remote(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("hello")
        r = await run_one(Subject(engine, None), "x", prompt, greedy(3))  # type: ignore[arg-type]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.ERROR
        assert r.finish.error is not None and "unreachable" in r.finish.error
        assert not r.finish.refused  # an engine failure: the job is retried
        assert engine.stats().running == 0
    finally:
        await engine.stop()


async def test_adapter_is_asked_of_the_upstream_by_name(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`tokenyard serve --lora NAME=PATH` upstream: the remote engine's adapter job is run
    there with the adapter, as PEFT's own generate runs it."""
    pytest.importorskip("peft")
    from tests.engines.outputs import collect
    from tests.loras import build_lora, peft_greedy
    from tokenyard.engines import EngineRequest

    model = ensure_tiny_model()
    lora = build_lora(model, tmp_path_factory.mktemp("lora") / "poet", seed=21)
    data = tmp_path_factory.mktemp("upstream-lora") / "valkey"
    with tokenyard_serve(data, "hf", "tiny", "--lora", f"poet={lora}") as url:
        engine = remote(url)
        await engine.start()
        try:
            prompt = engine.tokenizer.encode("Once upon a time")
            engine.add(EngineRequest("p", prompt, greedy(10), adapter="poet"))
            engine.add(EngineRequest("b", prompt, greedy(10)))
            done = await collect(engine, 2)
        finally:
            await engine.stop()
    assert done["p"].token_ids == peft_greedy(model, lora, prompt, 10)
    assert done["b"].token_ids == peft_greedy(model, None, prompt, 10) != done["p"].token_ids


async def sequences_ended() -> None:
    """Until no sequence's task runs: one that has given its finish may still be reading the
    end of its stream, and its connection is free once it has."""
    async with asyncio.timeout(30):
        while any(
            getattr(t.get_coro(), "__qualname__", "") == "StreamEngine._run" and not t.done()
            for t in asyncio.all_tasks()
        ):
            await asyncio.sleep(0.01)


async def test_sequences_run_one_after_another_share_one_connection(upstream: str) -> None:
    """A sequence that reaches its length reads the upstream's stream to its end, so that the
    next one is sent on the same kept-alive connection (a connection per sequence cost more
    CPU than the rest of the sequence's upstream leg)."""
    port = urlparse(upstream).port
    assert port is not None
    proxy = CuttingProxy(port, cuts=0, after=0)
    engine = remote(await proxy.start())
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("Once upon a time")
        for i in range(3):
            r = await run_one(Subject(engine, None), f"k{i}", prompt, greedy(5))  # type: ignore[arg-type]
            assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
            assert r.finish.completion_tokens == 5
            await sequences_ended()
        assert proxy.connections == 1
    finally:
        await engine.stop()
        await proxy.close()


async def test_upstream_is_reached_through_the_proxy_the_environment_names(
    upstream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY is honoured (as httpx, the engine's earlier client, did): the engine is
    given an upstream name that resolves nowhere, and reaches it through the proxy (here a
    TCP forwarder to the real upstream, which takes the proxy's absolute-form request)."""
    port = urlparse(upstream).port
    assert port is not None
    proxy = CuttingProxy(port, cuts=0, after=0)
    monkeypatch.setenv("HTTP_PROXY", await proxy.start())
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    engine = remote("http://upstream.invalid:8000", retries=0)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("Once upon a time")
        r = await run_one(Subject(engine, None), "p", prompt, greedy(4))  # type: ignore[arg-type]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH, r.finish
        assert proxy.connections == 1
    finally:
        await engine.stop()
        await proxy.close()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_https_upstream_is_trusted_by_ssl_cert_file(
    upstream: str, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https:// upstream whose certificate SSL_CERT_FILE holds is trusted (the CA files
    httpx, the engine's earlier client, trusted: SSL_CERT_FILE, else certifi's bundle)."""
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    port = urlparse(upstream).port
    assert port is not None

    async def terminate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # TLS ends here; the bytes go on to the upstream in the clear
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(terminate, "127.0.0.1", 0, ssl=tls)
    tls_port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    engine = remote(f"https://127.0.0.1:{tls_port}", retries=0)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("Once upon a time")
        r = await run_one(Subject(engine, None), "s", prompt, greedy(4))  # type: ignore[arg-type]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH, r.finish
    finally:
        await engine.stop()
        server.close()
