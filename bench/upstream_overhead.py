"""Upstream overhead: what tokenyard (and LiteLLM's proxy) add in front of an OpenAI-compatible
server that answers at once.

A mock upstream (aiohttp, its own process) answers /v1/completions and /v1/chat/completions,
streamed or not, with `max_tokens` tokens and their ids (`return_token_ids`, as vLLM does) in
a fraction of a millisecond. The targets are measured side by side in one run, each in its
own processes, the client (aiohttp, in this process) the same for all:

  direct     the mock itself.
  tokenyard  `tokenyard gateway` + `tokenyard worker --engine remote` pointed at the mock, a
             private Valkey (AOF everysec) on a free port, default logging (INFO, text: the
             gateway's access line per request), each process's log in a file.
  tokenyard-sim    the same on `--engine sim` at no cost per step: the queue path without
             the upstream leg (its requests do not reach the mock).
  floor      the same hops with no tokenyard code (bench/latency_floor.py): a raw ASGI app
             under uvicorn puts each request on a Valkey stream (the run's Valkey) and blocks on
             its own reply stream; a relay worker POSTs it to the mock on a kept-alive aiohttp
             session and writes the answer back. What uvicorn, one queue hop each way and an
             HTTP client cost on this box: tokenyard's added minus the floor's is its own code.
  tokenyard-serve  `tokenyard serve --engine remote`: gateway in serve's process, Valkey and
             the worker its children, every line on serve's stderr (a file here).
  litellm    `litellm --config` (its proxy) with the mock as an openai-compatible model, where
             a `litellm` executable is found (--litellm, else PATH, else
             .tokenyard/litellm-venv/bin/litellm); otherwise the JSON says why not.

Latency: rounds of one request to each target, in a seeded shuffled order (drift on a shared
host hits them alike); added = a target's E2E minus the direct median, p50 and p99.
Throughput: each target in turn under a closed loop of --concurrency requests in flight for
--load-s seconds (after a warm-up): req/s, E2E, errors, and the CPU ms per request of every
process of that target (from /proc: mock, gateway, worker, valkey, litellm, and this client).
Last, the remote engine alone (`remote_engine_alone`): driven in this process through its API
against the mock, one sequence at a time and --concurrency in flight, CPU per sequence of this
process and of the mock: the upstream leg's own cost, without gateway, queue or worker.
Requests are non-streamed completions (`--endpoint chat`: chat completions) of --max-tokens
tokens, greedy, ignore_eos. Prints one JSON document.

    python -m bench.upstream_overhead [--requests 300] [--warmup 30] [--concurrency 64]
        [--load-s 10] [--targets direct,tokenyard,tokenyard-sim,floor,tokenyard-serve,litellm]
        [--endpoint completions|chat]
        [--profile DIR] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import latency_floor
from bench.common import loadavg, proc_cpu_s
from tokenyard.bench.stats import summarize
from tokenyard.fleet.launch import Launcher, Processes, free_port, tokenyard_command, wait_ready

SELF_COMMAND = [sys.executable, "-m", "bench.upstream_overhead"]
MODEL = "tiny"  # tokenyard's remote engine needs the model's tokenizer; the mock needs none
TARGETS = ("direct", "tokenyard", "tokenyard-sim", "floor", "tokenyard-serve", "litellm")
MS = 1000.0
GOAL = {"added_p50_ms": 2.0, "added_p99_ms": 5.0, "req_per_s": 1500.0}
PROVIDERS = {"completions": "text-completion-openai", "chat": "openai"}  # LiteLLM's, per endpoint
TOKEN_ID = 1000  # the id the mock answers every token with (a word piece of the tiny vocab)
PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running far away"


# -- the mock upstream -----------------------------------------------------------------------


def _completion_chunk(model: str, chat: bool, created: int, ids: list[int], reason: str | None):
    # one SSE event as vLLM streams it, with the tokens' ids (`return_token_ids`)
    text = " a" * len(ids)
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "token_ids": ids}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = reason
    return {"id": "cmpl-mock", "object": kind, "created": created, "model": model,
            "choices": [choice]}  # fmt: skip


def mock_main(port: int) -> None:
    """The mock upstream: every request gets `max_tokens` tokens (16 if unset) at once."""
    from aiohttp import web

    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def models(request: web.Request) -> web.Response:
        data = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]}
        return web.json_response(data)

    async def complete(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        model = str(body.get("model", MODEL))
        created = int(time.time())
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 16
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n}  # fmt: skip
        if body.get("stream"):
            events = [
                _completion_chunk(
                    model, chat, created, [TOKEN_ID], "length" if i == n - 1 else None
                )
                for i in range(n)
            ]
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append({"id": "cmpl-mock", "object": "text_completion", "created": created,
                               "model": model, "choices": [], "usage": usage})  # fmt: skip
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            # chunked, as an upstream streams (its events in one write: it answers at once)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(payload + b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        ids = [TOKEN_ID] * n
        if chat:
            message = {"role": "assistant", "content": " a" * n}
            choice: dict[str, Any] = {"index": 0, "message": message, "token_ids": ids}
        else:
            choice = {"index": 0, "text": " a" * n, "token_ids": ids, "logprobs": None}
        choice["finish_reason"] = "length"
        kind = "chat.completion" if chat else "text_completion"
        return web.json_response({"id": "cmpl-mock", "object": kind, "created": created,
                                  "model": model, "choices": [choice], "usage": usage})  # fmt: skip

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- the targets -----------------------------------------------------------------------------


@dataclass
class Target:
    """One target's base URL and the processes whose CPU it costs (name -> pid)."""

    name: str
    base_url: str
    pids: dict[str, int] = field(default_factory=dict)
    api_key: str = "mock"
    model: str = MODEL  # the name the target serves the mock's model by


def find_litellm(given: str | None) -> str | None:
    if given:
        return given if Path(given).exists() else None
    found = shutil.which("litellm")
    if found:
        return found
    local = Path(".tokenyard/litellm-venv/bin/litellm")
    return str(local.resolve()) if local.exists() else None


def litellm_version(binary: str) -> str | None:
    python = Path(binary).parent / "python"
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or None


@contextlib.asynccontextmanager
async def stacks(
    opts: argparse.Namespace, log_dir: Path, notes: dict[str, Any]
) -> AsyncIterator[dict[str, Target]]:
    """The mock and every target's processes, started and ready; stopped at the end."""
    from tokenyard.broker.redis.embedded import EmbeddedServer

    procs = Processes(log_dir)
    targets: dict[str, Target] = {}
    with contextlib.ExitStack() as stack:
        try:
            mock_port = free_port()
            mock = procs.start("mock", [*SELF_COMMAND, "--run-mock", "--port", str(mock_port)])
            mock_url = f"http://127.0.0.1:{mock_port}"
            await asyncio.to_thread(wait_ready, f"{mock_url}/v1/models", procs)
            targets["direct"] = Target("direct", mock_url, {"mock": mock.pid})
            server = None
            for name in ("tokenyard", "tokenyard-sim"):
                if name not in opts.targets:
                    continue
                if server is None:
                    server = stack.enter_context(EmbeddedServer())
                engine = "remote" if name == "tokenyard" else "sim"
                targets[name] = await start_tokenyard(
                    name, engine, procs, server.url, mock_url, opts.concurrency
                )
                targets[name].pids["mock"] = mock.pid
                if server.pid is not None:
                    targets[name].pids["valkey"] = server.pid
            if "floor" in opts.targets:
                if server is None:
                    server = stack.enter_context(EmbeddedServer())
                targets["floor"] = await start_floor(procs, server.url, mock_url, opts)
                targets["floor"].pids["mock"] = mock.pid
                if server.pid is not None:
                    targets["floor"].pids["valkey"] = server.pid
            if "tokenyard-serve" in opts.targets:
                targets["tokenyard-serve"] = await start_serve(procs, mock_url, log_dir, opts)
                targets["tokenyard-serve"].pids["mock"] = mock.pid
            if "litellm" in opts.targets:
                binary = find_litellm(opts.litellm)
                if binary is None:
                    notes["litellm"] = (
                        "not measured: no `litellm` executable (pip install 'litellm[proxy]'; "
                        "here into .tokenyard/litellm-venv, as its pins would downgrade "
                        "huggingface-hub, rich and websockets in tokenyard's own venv)"
                    )
                else:
                    notes["litellm"] = f"litellm {litellm_version(binary)} ({binary})"
                    targets["litellm"] = await start_litellm(
                        binary, procs, mock_url, log_dir, opts.endpoint
                    )
                    targets["litellm"].pids["mock"] = mock.pid
            yield targets
        finally:
            procs.stop(timeout_s=30)


async def start_tokenyard(
    name: str, engine: str, procs: Processes, valkey_url: str, mock_url: str, concurrency: int
) -> Target:
    """`tokenyard gateway` + `tokenyard worker` on the run's Valkey (a prefix of their own),
    default logging: `remote` pointed at the mock, or `sim` at no cost per step (what the
    queue path costs without the upstream leg)."""
    launcher = Launcher(procs, valkey_url, f"uo{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "TOKENYARD_WORKER_REMOTE_URL": mock_url}
    model = MODEL if engine == "remote" else "sim"
    if engine == "sim":
        for cost in ("PREFILL_BASE_S", "PREFILL_PER_TOKEN_S", "DECODE_BASE_S", "DECODE_PER_SEQ_S"):
            env[f"TOKENYARD_WORKER_SIM_{cost}"] = "0"
    worker = launcher.worker(
        "--engine", engine, "--model", model, "--max-seqs", str(max(concurrency, 64)),
        name=f"{name}-worker", env=env,
    )  # fmt: skip
    port = free_port()
    gateway = launcher.gateway(
        port, "--model", model, "--engine", engine, name=f"{name}-gateway", env=env
    )
    base = f"http://127.0.0.1:{port}"
    await asyncio.to_thread(wait_ready, f"{base}/readyz", procs, timeout_s=180.0)
    return Target(name, base, {"gateway": gateway.pid, "worker": worker.pid}, model=model)


async def start_floor(
    procs: Processes, valkey_url: str, mock_url: str, opts: argparse.Namespace
) -> Target:
    """The latency floor in front of the mock: its server and relay worker on the run's Valkey
    (a key of their own)."""
    key, port = f"uf{uuid.uuid4().hex[:8]}:floor", free_port()
    path, _ = request_body(opts, MODEL)
    relay = latency_floor.relay_command(valkey_url, key, mock_url + path)
    server, worker = await latency_floor.start_floor(procs, valkey_url, key, port, relay)
    return Target("floor", f"http://127.0.0.1:{port}", {"gateway": server, "worker": worker})


async def start_serve(
    procs: Processes, mock_url: str, log_dir: Path, opts: argparse.Namespace
) -> Target:
    """`tokenyard serve --engine remote`: the gateway in serve's process, its private Valkey
    and worker as its children (their lines on serve's stderr, here its log file)."""
    port = free_port()
    env = {**os.environ, "TOKENYARD_WORKER_REMOTE_URL": mock_url}
    serve = procs.start(
        "tokenyard-serve",
        tokenyard_command(
            "serve", "--engine", "remote", "--model", MODEL, "--port", str(port),
            "--max-seqs", str(max(opts.concurrency, 64)), "--data-dir", str(log_dir / "serve"),
        ),
        env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    await asyncio.to_thread(wait_ready, f"{base}/readyz", procs, timeout_s=180.0)
    pids = {"serve": serve.pid}
    for child in children(serve.pid):
        name = "valkey" if "valkey" in _comm(child) else "worker"
        pids[name if name not in pids else f"{name}-{child}"] = child
    return Target("tokenyard-serve", base, pids)


def children(pid: int) -> list[int]:
    """A process's child processes (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


async def start_litellm(
    binary: str, procs: Processes, mock_url: str, log_dir: Path, endpoint: str
) -> Target:
    """LiteLLM's proxy with the mock as its one model (its openai-compatible provider for the
    endpoint measured); one uvicorn worker, its default logging."""
    config = log_dir / "litellm.yaml"
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": MODEL,
                        "litellm_params": {
                            # its openai-compatible provider for text completions, or chat
                            "model": f"{PROVIDERS[endpoint]}/{MODEL}",
                            "api_base": f"{mock_url}/v1",
                            "api_key": "mock",
                        },
                    }
                ],
                # ignore_eos and the like are the upstream's; LiteLLM refuses what it does
                # not know of unless told to drop it
                "litellm_settings": {"drop_params": True},
            }
        )
    )
    port = free_port()
    key = f"sk-{uuid.uuid4().hex}{uuid.uuid4().hex}"  # it refuses to start without a key
    env = {**os.environ, "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True",
           "LITELLM_MASTER_KEY": key}  # fmt: skip
    proc = procs.start(
        "litellm",
        [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", "1"],
        env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    await asyncio.to_thread(wait_ready, f"{base}/health/liveliness", procs, timeout_s=240.0)
    return Target("litellm", base, {"litellm": proc.pid}, key)


# -- the client ------------------------------------------------------------------------------


def request_body(opts: argparse.Namespace, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": opts.max_tokens,
                            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    if opts.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": PROMPT}]}
    return "/v1/completions", {**body, "prompt": PROMPT}


class Client:
    """One aiohttp session per target (keep-alive connections up to `connections`)."""

    def __init__(self, target: Target, opts: argparse.Namespace, connections: int) -> None:
        self.target = target
        self.path, body = request_body(opts, target.model)
        self.payload = json.dumps(body).encode()
        self.max_tokens = opts.max_tokens
        self.session = aiohttp.ClientSession(
            base_url=target.base_url,
            connector=aiohttp.TCPConnector(limit=connections),
            timeout=aiohttp.ClientTimeout(total=60.0),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {target.api_key}",
            },
        )

    async def one(self) -> tuple[float, str | None]:
        """One request: (E2E seconds, error or None)."""
        started = time.perf_counter()
        try:
            async with self.session.post(self.path, data=self.payload) as resp:
                data = await resp.read()
                if resp.status != 200:
                    return time.perf_counter() - started, f"http_{resp.status}"
            elapsed = time.perf_counter() - started
            if json.loads(data)["usage"]["completion_tokens"] != self.max_tokens:
                return elapsed, "short_output"
            return elapsed, None
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            return time.perf_counter() - started, type(exc).__name__

    async def close(self) -> None:
        await self.session.close()


def ms(values: Sequence[float]) -> dict[str, Any]:
    return summarize(values, (50.0, 90.0, 99.0)).as_dict(MS)


async def latency(opts: argparse.Namespace, targets: dict[str, Target]) -> dict[str, Any]:
    """Rounds of one request per target, shuffled; added = E2E - the direct median."""
    clients = {name: Client(t, opts, 1) for name, t in targets.items()}
    rng = random.Random(opts.seed)
    e2e: dict[str, list[float]] = {name: [] for name in targets}
    errors: dict[str, dict[str, int]] = {name: {} for name in targets}
    # the mock serves every target here: its CPU is counted under direct only
    shared = {name: Target(name, t.base_url, {k: v for k, v in t.pids.items() if k != "mock"
                                               or name == "direct"})
              for name, t in targets.items()}  # fmt: skip
    cpu0 = {name: cpu_of(t) for name, t in shared.items()}
    try:
        for i in range(opts.warmup + opts.requests):
            order = list(clients)
            rng.shuffle(order)
            for name in order:
                elapsed, error = await clients[name].one()
                if i < opts.warmup:
                    continue
                if error is None:
                    e2e[name].append(elapsed)
                else:
                    errors[name][error] = errors[name].get(error, 0) + 1
    finally:
        for c in clients.values():
            await c.close()
    base = statistics.median(e2e["direct"])
    out: dict[str, Any] = {}
    for name in targets:
        cpu = cpu_delta(shared[name], cpu0[name], opts.requests)
        cell = {"e2e_ms": ms(e2e[name]), "errors": errors[name], "cpu_ms_per_request": cpu}
        if name != "direct":
            cell["added_ms"] = ms([v - base for v in e2e[name]])
        out[name] = cell
    return out


def cpu_of(target: Target) -> dict[str, float]:
    return {name: proc_cpu_s(pid) for name, pid in target.pids.items()}


def cpu_delta(target: Target, before: dict[str, float], requests: int) -> dict[str, float]:
    """CPU ms per request of each of the target's processes since `before`."""
    now = cpu_of(target)
    return {
        name: round((now[name] - before[name]) * MS / max(requests, 1), 3) for name in target.pids
    }


async def load(opts: argparse.Namespace, target: Target) -> dict[str, Any]:
    """A closed loop of --concurrency requests in flight for --load-s seconds."""
    client = Client(target, opts, opts.concurrency)
    e2e: list[float] = []
    errors: dict[str, int] = {}
    try:
        warm_until = time.perf_counter() + opts.load_warmup_s

        async def loop(until: float, keep: bool) -> None:
            while time.perf_counter() < until:
                elapsed, error = await client.one()
                if not keep:
                    continue
                if error is None:
                    e2e.append(elapsed)
                else:
                    errors[error] = errors.get(error, 0) + 1

        await asyncio.gather(*(loop(warm_until, False) for _ in range(opts.concurrency)))
        cpu0, self0 = cpu_of(target), proc_cpu_s(os.getpid())
        started = time.perf_counter()
        until = started + opts.load_s
        await asyncio.gather(*(loop(until, True) for _ in range(opts.concurrency)))
        wall = time.perf_counter() - started
    finally:
        await client.close()
    n = len(e2e) + sum(errors.values())
    cpu = cpu_delta(target, cpu0, n)
    cpu["client"] = round((proc_cpu_s(os.getpid()) - self0) * MS / max(n, 1), 3)
    cpu["total_server"] = round(sum(v for k, v in cpu.items() if k != "client"), 3)
    return {
        "concurrency": opts.concurrency,
        "requests": n,
        "errors": errors,
        "wall_s": round(wall, 2),
        "req_per_s": round(len(e2e) / wall, 1),
        "e2e_ms": ms(e2e),
        "cpu_ms_per_request": cpu,
    }


async def engine_alone(opts: argparse.Namespace, mock: Target) -> dict[str, Any]:
    """The remote engine in this process against the mock, through its API (add, outputs):
    the upstream leg's own cost, with no gateway, queue or worker around it. One sequence at
    a time, then --concurrency in flight for --load-s seconds; CPU of this process (the
    engine and the loop reading its outputs) and of the mock, per sequence."""
    from tokenyard.engines import EngineRequest, make_engine
    from tokenyard.messages import SamplingParams

    engine = make_engine("remote", model=MODEL, url=mock.base_url, concurrency=opts.concurrency)
    await engine.start()
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)
    prompt = engine.tokenizer.encode(PROMPT)
    waiting: dict[str, asyncio.Future[bool]] = {}
    sequences = iter(range(1 << 62))

    async def read_outputs() -> None:
        while True:
            for out in await engine.outputs():
                if out.finish_reason is not None and out.seq_id in waiting:
                    waiting.pop(out.seq_id).set_result(out.error is None)

    async def one() -> tuple[float, bool]:
        seq_id = f"e{next(sequences)}"
        done = waiting[seq_id] = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        engine.add(EngineRequest(seq_id, prompt, params))
        ok = await done
        return time.perf_counter() - started, ok

    def cpu() -> tuple[float, float]:
        return proc_cpu_s(os.getpid()), proc_cpu_s(mock.pids["mock"])

    def per_request(before: tuple[float, float], n: int) -> dict[str, float]:
        now = cpu()
        return {"engine": round((now[0] - before[0]) * MS / n, 3),
                "mock": round((now[1] - before[1]) * MS / n, 3)}  # fmt: skip

    reader = asyncio.create_task(read_outputs())
    try:
        for _ in range(opts.warmup):
            await one()
        before = cpu()
        single = [await one() for _ in range(opts.requests)]
        one_at_a_time = {
            "e2e_ms": ms([t for t, ok in single if ok]),
            "errors": sum(1 for _, ok in single if not ok),
            "cpu_ms_per_request": per_request(before, len(single)),
        }
        results: list[tuple[float, bool]] = []

        async def loop(until: float) -> None:
            while time.perf_counter() < until:
                results.append(await one())

        before, started = cpu(), time.perf_counter()
        await asyncio.gather(*(loop(started + opts.load_s) for _ in range(opts.concurrency)))
        wall = time.perf_counter() - started
    finally:
        reader.cancel()
        await engine.stop()
    return {
        "one_at_a_time": one_at_a_time,
        "in_flight": {
            "concurrency": opts.concurrency,
            "requests": len(results),
            "errors": sum(1 for _, ok in results if not ok),
            "req_per_s": round(len(results) / wall, 1),
            "cpu_ms_per_request": per_request(before, len(results)),
        },
    }


@contextlib.contextmanager
def profiling(opts: argparse.Namespace, target: Target) -> Any:
    """py-spy record (if installed) on the tokenyard processes during its load phase."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if opts.profile is None or target.name != "tokenyard" or not Path(spy).exists():
        yield
        return
    opts.profile.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(target.pids[name]),
                "--rate",
                "250",
                "--nonblocking",
                "--duration",
                str(int(opts.load_s)),
                "--format",
                "raw",
                "--output",
                str(opts.profile / f"{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in ("gateway", "worker")
    ]
    try:
        yield
    finally:
        for s in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.wait(opts.load_s + 30)


def judge(out: dict[str, Any]) -> dict[str, Any]:
    ty = out["latency"].get("tokenyard")
    loaded = out["load"].get("tokenyard")
    if ty is None or loaded is None:
        return {}
    checks = {
        "added_p50_ms": ty["added_ms"]["p50"],
        "added_p99_ms": ty["added_ms"]["p99"],
        "req_per_s": loaded["req_per_s"],
    }
    return {
        name: {
            "value": value,
            "goal": GOAL[name],
            "met": value is not None
            and (value >= GOAL[name] if name == "req_per_s" else value <= GOAL[name]),
        }
        for name, value in checks.items()
    }


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = loadavg()
    notes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ty-uo-") as tmp:
        log_dir = Path(opts.log_dir or tmp)
        async with stacks(opts, log_dir, notes) as targets:
            lat = await latency(opts, targets)
            loaded: dict[str, Any] = {}
            for name, target in targets.items():
                with profiling(opts, target):
                    loaded[name] = await load(opts, target)
            alone = await engine_alone(opts, targets["direct"]) if opts.engine_alone else None
    out: dict[str, Any] = {
        "benchmark": "upstream_overhead",
        "config": {
            "requests": opts.requests,
            "warmup_rounds": opts.warmup,
            "endpoint": opts.endpoint,
            "max_tokens": opts.max_tokens,
            "concurrency": opts.concurrency,
            "load_s": opts.load_s,
            "mock": "aiohttp (uvloop) in its own process: every request answered at once with "
            "max_tokens tokens and their ids",
            "tokenyard": "tokenyard gateway + tokenyard worker --engine remote (pointed at the "
            "mock) + private Valkey, one process each, default logging to files",
            "litellm": notes.get("litellm", "not asked for"),
            "client": "aiohttp in this process; latency: one keep-alive connection per target, "
            "one request at a time in shuffled rounds; load: a closed loop of `concurrency` "
            "requests in flight per target in turn",
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        },
        "latency": lat,
        "load": loaded,
        "remote_engine_alone": alone,
    }
    out["goals"] = judge(out)
    ratios: dict[str, Any] = {}
    for name in TARGETS[1:]:
        if name in lat and name in loaded:
            ratios[name] = {
                "req_per_s_vs_direct": round(
                    loaded[name]["req_per_s"] / max(loaded["direct"]["req_per_s"], 1e-9), 3
                ),
                "server_cpu_ms_per_request": loaded[name]["cpu_ms_per_request"]["total_server"],
            }
    out["ratios"] = ratios
    if "floor" in lat:
        # what tokenyard's own code adds beyond the same hops with none of it
        floor = lat["floor"]["added_ms"]
        out["beyond_floor_ms"] = {
            name: {q: round(lat[name]["added_ms"][q] - floor[q], 3) for q in ("p50", "p99")}
            for name in ("tokenyard", "tokenyard-sim")
            if name in lat
        }
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, help="measured rounds, one request per target (300)")
    p.add_argument("--warmup", type=int, help="unmeasured rounds first (30)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight under load")
    p.add_argument("--load-s", type=float, help="seconds each target runs under load (10)")
    p.add_argument("--load-warmup-s", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS)
    )
    p.add_argument("--litellm", help="the litellm executable (default: PATH, then the venv)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-engine-alone",
        dest="engine_alone",
        action="store_false",
        help="skip the remote engine driven alone in this process against the mock",
    )
    p.add_argument("--profile", type=Path, help="py-spy tokenyard's gateway and worker into DIR")
    p.add_argument("--log-dir", type=Path, help="keep the processes' logs here")
    p.add_argument("--quick", action="store_true", help="smoke run: 20 requests, 2 s of load")
    p.add_argument("--run-mock", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.requests = a.requests if a.requests is not None else (20 if a.quick else 300)
    a.warmup = a.warmup if a.warmup is not None else (5 if a.quick else 30)
    a.load_s = a.load_s if a.load_s is not None else (2.0 if a.quick else 10.0)
    a.targets = tuple(t for t in a.targets.split(",") if t)
    unknown = set(a.targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.run_mock:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        mock_main(opts.port)
        return
    print(json.dumps(asyncio.run(run(opts)), indent=2))


if __name__ == "__main__":
    main()
