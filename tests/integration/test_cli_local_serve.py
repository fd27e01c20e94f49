"""The command line finds the running `serve` or says so, and fails fast and in one line: the
commands given no broker (or gateway URL) use the local serve's, from its directory or one
below; a second serve on its data dir stops, naming it; serve refuses a taken port, an unknown
engine, bad settings and a model neither on disk nor in the Hugging Face cache before it starts
anything, and stops when a worker cannot start; a broker or gateway that does not answer is one
line (`--debug`: the traceback). One serve for the file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any TOKENYARD_ setting: nothing names a broker or a gateway."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    return env | extra


@dataclass
class Ran:
    args: Sequence[str]
    code: int
    out: str
    err: str

    def one_failure_line(self) -> str:
        """The single stderr line of a command that failed, without a traceback."""
        assert self.code not in (0, None), self
        lines = self.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in self.err, self
        assert lines[0].startswith("tokenyard: "), self
        return lines[0]


def run_all(
    commands: Sequence[Sequence[str]], cwd: Path, env: Mapping[str, str], timeout_s: float = 90
) -> list[Ran]:
    """Run the commands at once (each is a Python start-up: seconds), wait for them all."""
    procs = [
        subprocess.Popen(
            tokenyard_command(*args),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    ran = []
    for args, proc in zip(commands, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{args} still ran after {timeout_s} s: {err[-2000:]}")
        ran.append(Ran(args, proc.returncode, out, err))
    return ran


@dataclass
class Served:
    cwd: Path  # serve's working directory: its record is in .tokenyard/valkey/serve.json
    port: int
    procs: Processes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cwd = tmp_path_factory.mktemp("local-serve")
    port = free_port()
    procs = Processes(log_dir=cwd / "logs")
    serve = procs.start(
        "serve",
        tokenyard_command("serve", "--engine", "sim", "--model", "tiny", "--port", str(port)),
        env=clean_env(),
        cwd=cwd,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz", procs, timeout_s=120)
        give_up = time.monotonic() + 30  # its banner and "ready" line follow the first worker
        while " tokenyard.serve ready " not in procs.log_tail("serve", chars=100_000):
            assert time.monotonic() < give_up, procs.log_tail("serve")
            time.sleep(0.05)
        yield Served(cwd, port, procs)
        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        assert not (cwd / ".tokenyard" / "valkey" / "serve.json").exists()  # serve forgot it
    finally:
        procs.stop(timeout_s=30, sig=signal.SIGKILL)


def test_serve_says_what_it_started_and_where(served: Served) -> None:
    started = served.procs.log_tail("serve", chars=100_000)
    for where in ("/v1", "/dashboard", "/metrics", "/docs"):
        assert f"{served.url}{where}" in started, started
    assert "broker     redis://127.0.0.1:" in started
    assert "engine sim" in started and "workers 1" in started and "model tiny" in started
    record = json.loads((served.cwd / ".tokenyard" / "valkey" / "serve.json").read_bytes())
    assert record["api_url"] == served.url and record["broker_url"].startswith("redis://")
    assert (served.cwd / ".tokenyard" / "valkey" / "serve.json").stat().st_mode & 0o077 == 0


def test_commands_given_no_broker_use_the_local_serve(served: Served) -> None:
    env = clean_env()
    metrics_port = free_port()
    autoscale = served.procs.start(
        "autoscale",
        tokenyard_command("autoscale", "--port", str(metrics_port), "--host", "127.0.0.1"),
        env=env,
        cwd=served.cwd,
    )
    (submitted,) = run_all([("submit", "hello yard", "--max-tokens", "4")], served.cwd, env)
    assert submitted.code == 0 and submitted.out.strip(), submitted  # the serve's gateway
    status, tenants, audit = run_all(
        [("status",), ("tenants", "show"), ("audit", "--since", "1h")], served.cwd, env
    )
    assert status.code == 0 and "model tiny" in status.out, status
    assert tenants.code == 0, tenants
    assert audit.code == 0, audit
    assert {json.loads(line)["tenant"] for line in audit.out.splitlines()} == {"default"}
    # autoscale runs until stopped: its gauges show it read the serve's lanes
    wait_ready(f"http://127.0.0.1:{metrics_port}/metrics", autoscale, timeout_s=60)
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert 'tokenyard_desired_workers{model="tiny"}' in metrics
    autoscale.send_signal(signal.SIGTERM)
    assert autoscale.wait(30) == 0


def test_serve_refuses_at_once_what_it_cannot_run(served: Served, tmp_path: Path) -> None:
    # a Hugging Face cache without the model, and no hub to ask
    offline = clean_env(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    with socket.socket() as held:  # a broker address nobody answers on
        held.bind(("127.0.0.1", 0))
        nobody = f"redis://127.0.0.1:{held.getsockname()[1]}/0"
        taken, bad_engine, bad_seqs, no_broker, no_model, worker, gateway = run_all(
            [
                ("serve", "--engine", "sim", "--port", str(served.port)),  # the served one's
                ("serve", "--engine", "nope", "--port", str(free_port())),
                ("serve", "--engine", "sim", "--max-seqs", "-4", "--port", str(free_port())),
                ("serve", "--engine", "sim", "--broker", nobody, "--port", str(free_port())),
                ("serve", "--engine", "hf", "--model", "nobody/none", "--port", str(free_port())),
                ("worker", "--engine", "hf", "--model", "nobody/none", "--broker", nobody),
                ("gateway", "--model", "nobody/none", "--broker", nobody),
            ],
            tmp_path,
            offline,
        )
    assert f"127.0.0.1:{served.port} is taken" in taken.one_failure_line()
    assert "unknown engine 'nope'" in bad_engine.one_failure_line()
    assert "max_seqs = -4" in bad_seqs.one_failure_line()
    assert f"no answer from the broker at {nobody}" in no_broker.one_failure_line()
    for ran in (no_model, worker, gateway):
        line = ran.one_failure_line()
        assert (
            "model nobody/none is neither a local directory nor in the Hugging Face cache" in line
        )
        assert "HF_HUB_OFFLINE=1 forbids downloading it" in line
    assert not (tmp_path / ".tokenyard").exists()  # nothing was started


def test_a_second_serve_on_a_data_dir_stops_naming_the_first(served: Served) -> None:
    record = served.cwd / ".tokenyard" / "valkey" / "serve.json"
    before = record.read_bytes()
    pid = json.loads(before)["pid"]
    # on another port, and on the first one's: the data dir is what they share, said first
    elsewhere, same_port = run_all(
        [
            ("serve", "--engine", "sim", "--port", str(free_port())),
            ("serve", "--engine", "sim", "--port", str(served.port)),
        ],
        served.cwd,
        clean_env(),
    )
    for ran in (elsewhere, same_port):
        assert ran.one_failure_line() == (
            f"tokenyard: a serve already runs on .tokenyard/valkey (pid {pid}, {served.url}); "
            "stop it first, or give this one another --data-dir"
        )
    assert record.read_bytes() == before  # the first one's record, untouched
    assert httpx.get(f"{served.url}/readyz").status_code == 200


def test_commands_in_a_subdirectory_find_the_serve_and_batches_use_it(served: Served) -> None:
    below = served.cwd / "jobs" / "today"
    below.mkdir(parents=True, exist_ok=True)
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": f"car {i}", "max_tokens": 4}}
        for i in range(3)
    ]  # fmt: skip
    (below / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    status, batch = run_all(
        [("status",), ("batch", "submit", "in.jsonl", "--wait", "--output", "out.jsonl")],
        below,
        clean_env(),
    )
    assert status.code == 0 and "model tiny" in status.out, status
    assert batch.code == 0 and batch.out.startswith("batch_"), batch
    results = [json.loads(line) for line in (below / "out.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1", "r2"]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_a_worker_that_cannot_start_stops_serve(served: Served, tmp_path: Path) -> None:
    # the worker's metrics port is taken (serve does not read it): only the worker fails
    env = clean_env(TOKENYARD_WORKER_METRICS_PORT=str(served.port))
    (ran,) = run_all(
        [("serve", "--engine", "sim", "--port", str(free_port()))], tmp_path, env, timeout_s=120
    )
    lines = ran.err.strip().splitlines()
    assert ran.code not in (0, None) and "Traceback" not in ran.err, ran
    assert lines[-1].startswith("tokenyard: worker 1 exited"), ran
    assert "Address already in use" in lines[-1], ran
    assert not (tmp_path / ".tokenyard" / "valkey" / "serve.json").exists()


def test_config_show_refuses_an_unknown_table(tmp_path: Path) -> None:
    # its other refusals and the [autoscale] table: tests/unit/test_config_file.py
    (tmp_path / "tokenyard.toml").write_text("[workers]\nmax_seqs = 4\n")
    (ran,) = run_all([("--config", "tokenyard.toml", "config", "show")], tmp_path, clean_env())
    assert "unknown table [workers]" in ran.one_failure_line()


def test_a_broker_or_gateway_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as held:  # a port nobody answers on while the commands run
        held.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{held.getsockname()[1]}"
        env = clean_env(TOKENYARD_GATEWAY_PORT=str(held.getsockname()[1]))
        status, nats, submitted, debug = run_all(
            [
                ("status", "--broker", f"redis://{nobody}/0"),
                ("keys", "list", "--broker", f"nats://{nobody}"),
                ("submit", "hello"),
                ("tenants", "show", "--debug", "--broker", f"redis://{nobody}/0"),
            ],
            tmp_path,
            env,
        )
    assert f"no answer from the broker at redis://{nobody}/0" in status.one_failure_line()
    assert f"no answer from the broker at nats://{nobody}" in nats.one_failure_line()
    assert f"no gateway answers at http://{nobody}" in submitted.one_failure_line()
    assert debug.code != 0 and "Traceback" in debug.err and "BrokerUnavailable" in debug.err


def test_serve_logs_only_json_and_says_ready_once_its_model_answers(tmp_path: Path) -> None:
    # the hf engine on the tiny model: transformers logs through handlers of its own, and
    # torch's native bindings print at exit; the worker writes to serve's stderr directly
    port = free_port()
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        serve = subprocess.Popen(
            tokenyard_command(
                "serve", "--engine", "hf", "--model", "tiny", "--port", str(port),
                "--log-format", "json",
            ),
            cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        )  # fmt: skip
    try:

        def lines() -> list[dict[str, object]]:
            return [json.loads(line) for line in err.read_text().splitlines()]

        give_up = time.monotonic() + 150
        while not any(line["message"] == "ready" for line in lines()):
            assert serve.poll() is None and time.monotonic() < give_up, err.read_text()[-3000:]
            time.sleep(0.1)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            headers={"X-Request-Id": "json-check"},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "json-check"
        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    logged = lines()  # every line of serve's stream is JSON (json.loads raises otherwise)
    assert out.read_text() == ""  # the banner is a line of the stream too
    messages = [line["message"] for line in logged]
    worker_up = next(i for i, line in enumerate(logged) if line.get("process") == "worker-1")
    banner = messages.index("tokenyard serve")
    assert worker_up < banner < messages.index("ready")  # the banner once the model answers
    ready = logged[messages.index("ready")]
    assert ready["workers"] == "tiny:1" and ready["api"] == f"http://127.0.0.1:{port}/v1"
    [access] = [line for line in logged if line.get("request_id") == "json-check"]
    assert access["logger"] == "tokenyard.access" and access["status"] == 200
    assert {line["logger"] for line in logged if line.get("process") == "worker-1"} >= {
        "tokenyard.worker.worker"
    }


def test_serve_shows_no_banner_for_a_model_it_cannot_load(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    (ran,) = run_all(
        [("serve", "--engine", "hf", "--model", str(tmp_path / "not-a-model"), "--port",
          str(free_port()))],
        tmp_path, clean_env(), timeout_s=120,
    )  # fmt: skip
    assert "not-a-model" in ran.one_failure_line()
    assert ran.out == ""  # no banner: nothing was ever ready
