"""`tokenyard bench` against a real (fake) OpenAI-compatible HTTP server on a free port."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tests.bench.fake_openai import BREAK_STREAM, FakeServer, running_fake_server
from tokenyard.bench.client import Endpoint, RequestOptions
from tokenyard.bench.report import build_report, render_table
from tokenyard.bench.runner import BenchSettings, Load, make_progress, run_level, run_sweep
from tokenyard.bench.workload import LengthDist, Workload, load_prompts
from tokenyard.cli.bench import bench
from tokenyard.fleet.launch import free_port


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with running_fake_server() as server:
        yield server


@pytest.fixture
def server(fake: FakeServer) -> FakeServer:
    fake.state.reset()
    return fake


def _settings(
    server: FakeServer,
    *,
    requests: int | None = 20,
    output: int = 8,
    endpoint: Endpoint = Endpoint.completions,
    usage: bool = True,
    duration_s: float | None = None,
) -> BenchSettings:
    return BenchSettings(
        base_url=server.url,
        api_key="sk-test",
        options=RequestOptions(endpoint=endpoint, model="fake", include_usage=usage),
        workload=Workload(prompt_len=LengthDist(5, 20), output_len=LengthDist(output, output)),
        requests=requests,
        duration_s=duration_s,
        seed=1,
        timeout_s=30,
    )


async def test_open_loop_report(server: FakeServer) -> None:
    settings = _settings(server)
    run = await run_level(settings, Load("open", 200.0))
    assert len(run.results) == 20 and all(r.ok for r in run.results)
    for r in run.results:
        assert r.ttft_s is not None and 0 < r.ttft_s < r.e2e_s
        assert len(r.itl_s) == 7 and all(gap >= 0 for gap in r.itl_s)
        assert r.output_tokens == 8 and r.usage_reported and r.finish_reason == "length"
        assert r.prompt_tokens is not None and 5 <= r.prompt_tokens <= 20

    level = build_report(settings, [run])["levels"][0]
    assert level["load"] == {"mode": "open", "rate": 200.0}
    assert level["requests"] == {"sent": 20, "completed": 20, "failed": 0}
    assert level["errors"] == {} and level["finish_reasons"] == {"length": 20}
    assert level["tokens"]["output"] == 160 and level["tokens"]["output_from_usage"]
    assert level["ttft_ms"]["count"] == 20 and level["e2e_ms"]["count"] == 20
    assert level["itl_ms"]["count"] == 20 * 7 and level["itl_ms"]["p50"] > 0
    # the server waits 10 ms before the first token and 2 ms between tokens
    assert level["ttft_ms"]["p50"] >= 9 and level["e2e_ms"]["p50"] >= 9 + 7 * 1.5
    assert level["ttft_ms"]["p99"] < level["e2e_ms"]["p99"]
    assert level["tpot_ms"]["p50"] >= 1.5
    throughput = level["throughput"]
    assert throughput["requests_per_s"] > 0
    assert throughput["output_tokens_per_s"] == pytest.approx(
        throughput["requests_per_s"] * 8, rel=0.01
    )

    body = server.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body and "min_tokens" not in body
    assert set(server.state.authorization) == {"Bearer sk-test"}


async def test_rejections_are_counted_by_status(server: FakeServer) -> None:
    server.state.reject_every = 4
    settings = _settings(server)
    run = await run_level(settings, Load("open", 500.0))
    level = build_report(settings, [run])["levels"][0]
    assert level["requests"] == {"sent": 20, "completed": 15, "failed": 5}
    assert level["errors"] == {"429": 5}
    assert level["error_examples"] == {"429": "rate limited"}
    # failures take no part in the latency statistics
    assert level["e2e_ms"]["count"] == 15 and level["tokens"]["output"] == 15 * 8


async def test_closed_loop_keeps_n_requests_in_flight(server: FakeServer) -> None:
    server.state.first_token_delay_s = 0.05  # long enough that the three clients overlap
    settings = _settings(server, requests=12)
    run = await run_level(settings, Load("closed", 3))
    assert len(run.results) == 12 and all(r.ok for r in run.results)
    assert server.state.max_in_flight == 3
    assert sorted(r.index for r in run.results) == list(range(12))


async def test_duration_bounds_an_open_loop(server: FakeServer) -> None:
    settings = _settings(server, requests=None, duration_s=0.5, output=2)
    run = await run_level(settings, Load("open", 40.0))
    # about 20 arrivals; a Poisson count this small varies, and every one must finish
    assert 5 <= len(run.results) <= 40 and all(r.ok for r in run.results)


async def test_chat_without_usage_counts_chunks(server: FakeServer) -> None:
    settings = _settings(server, requests=5, output=6, endpoint=Endpoint.chat, usage=False)
    run = await run_level(settings, Load("closed", 2))
    assert all(r.ok and not r.usage_reported for r in run.results)
    # the role chunk has no text: it is not a token and does not start the TTFT clock
    assert [r.output_tokens for r in run.results] == [6] * 5
    level = build_report(settings, [run])["levels"][0]
    assert level["tokens"] == {"output": 30, "prompt": None, "output_from_usage": False}
    body = server.state.bodies[0]
    assert "stream_options" not in body and body["messages"][0]["role"] == "user"


async def test_broken_streams_and_unreachable_servers(server: FakeServer, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(f"please {BREAK_STREAM}") + "\n")
    settings = _settings(server, requests=3)
    broken = replace(
        settings,
        workload=Workload(LengthDist(1, 1), LengthDist(5, 5), prompts=load_prompts(prompts)),
    )
    level = build_report(broken, [await run_level(broken, Load("open", 100.0))])["levels"][0]
    assert level["errors"] == {"stream_error": 3}
    assert level["error_examples"]["stream_error"] == "engine died"

    dead_url = f"http://127.0.0.1:{free_port()}/v1"
    dead = replace(settings, base_url=dead_url)
    level = build_report(dead, [await run_level(dead, Load("open", 100.0))])["levels"][0]
    assert level["errors"] == {"ConnectError": 3} and level["requests"]["completed"] == 0


async def test_sweep_with_progress(server: FakeServer) -> None:
    settings = _settings(server, requests=10, output=4)
    progress = make_progress(disable=True)
    runs = await run_sweep(settings, [Load("open", 50.0), Load("open", 200.0)], progress=progress)
    report = build_report(settings, runs)
    assert [lv["load"]["rate"] for lv in report["levels"]] == [50.0, 200.0]
    assert all(lv["requests"]["completed"] == 10 for lv in report["levels"])
    assert len(progress.tasks) == 2 and all(t.finished for t in progress.tasks)
    # each level draws its own prompts, so a response cache cannot serve the second one
    prompts = [b["prompt"] for b in server.state.bodies]
    assert len(set(prompts)) == 20
    assert render_table(report).row_count == 2


def _cli() -> typer.Typer:
    # registered the way tokenyard/cli/app.py registers it: a subcommand of a multi-command app
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """tokenyard."""

    app.command("bench")(bench)
    return app


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(_cli(), ["bench", *args], catch_exceptions=False)


def test_cli_sweep_writes_report_and_plot(server: FakeServer, tmp_path: Path) -> None:
    out, png = tmp_path / "report.json", tmp_path / "curve.png"
    result = _invoke(
        [
            "--base-url",
            server.url,
            "--model",
            "fake",
            "--endpoint",
            "chat",
            "--sweep",
            "40,80,160",
            "-n",
            "8",
            "--output-len",
            "3:5",
            "--ignore-eos",
            "--api-key",
            "k",
            "-o",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["endpoint"] == "chat" and report["config"]["ignore_eos"] is True
    assert "api_key" not in json.dumps(report["config"])
    assert [lv["load"] for lv in report["levels"]] == [
        {"mode": "open", "rate": r} for r in (40.0, 80.0, 160.0)
    ]
    assert all(lv["requests"]["completed"] == 8 for lv in report["levels"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert all(b["ignore_eos"] is True and "min_tokens" not in b for b in server.state.bodies)
    assert all(3 <= b["max_tokens"] <= 5 for b in server.state.bodies)


def test_cli_prints_json_and_fails_when_nothing_succeeds(server: FakeServer) -> None:
    result = _invoke(
        [
            "--base-url",
            server.url,
            "--model",
            "fake",
            "--concurrency",
            "2",
            "-n",
            "4",
            "--output-len",
            "2",
            "--quiet",
            "--min-tokens",
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["levels"][0]["load"] == {"mode": "closed", "concurrency": 2}
    assert server.state.bodies[0]["min_tokens"] == 2

    server.state.reject_every = 1
    refused = _invoke(
        ["--base-url", server.url, "--model", "fake", "--rate", "100", "-n", "3", "--quiet"]
    )
    assert refused.exit_code == 1
    assert json.loads(refused.stdout)["levels"][0]["errors"] == {"429": 3}


@pytest.mark.parametrize(
    "args",
    [
        ["--rate", "1", "--concurrency", "2"],
        [],
        ["--sweep", "1,x"],
        ["--sweep-concurrency", "1.5"],
        ["--rate", "1", "--prompt-len", "0"],
        ["--rate", "1", "--extra-body", "[1]"],
        ["--rate", "inf", "--duration", "2"],
    ],
)
def test_cli_rejects_bad_options(args: list[str]) -> None:
    result = _invoke(["--model", "m", *args])
    assert result.exit_code == 2, result.output
