"""The `tokenyard bench` command: options in, a load run, a JSON report (and a plot) out."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tokenyard.bench.client import Endpoint, RequestOptions
from tokenyard.bench.report import build_report, print_table, write_report
from tokenyard.bench.runner import BenchSettings, Load, make_progress, run_sweep
from tokenyard.bench.workload import LengthDist, Workload, load_prompts

DEFAULT_REQUESTS = 100


def parse_levels(text: str, *, whole: bool = False) -> list[float]:
    """`1,2,4.5` → [1.0, 2.0, 4.5]; every level positive (and whole, for client counts)."""
    levels: list[float] = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"not a number: {part.strip()!r}") from None
        if not value > 0 or (whole and (math.isinf(value) or value != int(value))):
            kind = "a positive whole number" if whole else "positive"
            raise ValueError(f"every level must be {kind}, got {part.strip()!r}")
        levels.append(value)
    if not levels:
        raise ValueError("no levels given")
    return levels


def choose_loads(
    rate: float | None,
    concurrency: int | None,
    sweep: str | None,
    sweep_concurrency: str | None,
) -> list[Load]:
    """The load levels from exactly one of the four load options."""
    given = [
        name
        for name, value in (
            ("--rate", rate),
            ("--concurrency", concurrency),
            ("--sweep", sweep),
            ("--sweep-concurrency", sweep_concurrency),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of --rate, --concurrency, --sweep, "
            f"--sweep-concurrency (got {', '.join(given) or 'none'})"
        )
    if rate is not None:
        return [Load("open", rate)]
    if concurrency is not None:
        return [Load("closed", concurrency)]
    if sweep is not None:
        return [Load("open", value) for value in parse_levels(sweep)]
    assert sweep_concurrency is not None
    return [Load("closed", value) for value in parse_levels(sweep_concurrency, whole=True)]


def parse_extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("--extra-body must be a JSON object")
    return value


def bench(
    model: Annotated[str, typer.Option(help="Model name sent in every request.")],
    base_url: Annotated[
        str, typer.Option(help="OpenAI-compatible base URL, including its /v1.")
    ] = "http://127.0.0.1:8000/v1",
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token.", show_default=False)
    ] = None,
    endpoint: Annotated[
        Endpoint, typer.Option(help="/v1/completions or /v1/chat/completions.")
    ] = Endpoint.completions,
    rate: Annotated[
        float | None,
        typer.Option(help="Open loop: Poisson arrivals per second (inf sends all at once)."),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(help="Closed loop: N clients, each sending when its last request ends."),
    ] = None,
    sweep: Annotated[
        str | None, typer.Option(help="Open-loop rates to run in turn, e.g. 1,2,4,8.")
    ] = None,
    sweep_concurrency: Annotated[
        str | None, typer.Option(help="Closed-loop client counts to run in turn, e.g. 1,4,16.")
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(
            "--requests",
            "-n",
            help=f"Requests per level (default {DEFAULT_REQUESTS} unless --duration is given).",
        ),
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Seconds per level to keep starting requests.")
    ] = None,
    prompt_len: Annotated[
        str, typer.Option(help="Prompt length in words (about tokens): N or LOW:HIGH.")
    ] = "128",
    output_len: Annotated[str, typer.Option(help="max_tokens: N or LOW:HIGH.")] = "128",
    prompts: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="JSONL of prompts: strings, or {prompt|messages, max_tokens?}.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of prompts, lengths and arrivals.")] = 0,
    ignore_eos: Annotated[
        bool, typer.Option(help="Send ignore_eos: true, so outputs run to max_tokens.")
    ] = False,
    min_tokens: Annotated[
        bool, typer.Option(help="Send min_tokens = max_tokens (vLLM; not every server).")
    ] = False,
    usage: Annotated[
        bool, typer.Option(help="Send stream_options.include_usage for exact token counts.")
    ] = True,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature.")] = None,
    extra_body: Annotated[
        str | None, typer.Option(help="JSON object merged into every request body.")
    ] = None,
    cache_bust: Annotated[
        bool, typer.Option(help="Tag every prompt uniquely, so no response cache answers it.")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="HTTP timeout in seconds: connect, and each read.")
    ] = 600.0,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the JSON report here.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Draw latency vs throughput to this PNG (matplotlib).")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar or table.")] = False,
) -> None:
    """Load-test an OpenAI-compatible endpoint; print (or write) a JSON latency report.

    Exit status 1 when no request succeeded at any level.
    """
    try:
        loads = choose_loads(rate, concurrency, sweep, sweep_concurrency)
        workload = Workload(
            prompt_len=LengthDist.parse(prompt_len),
            output_len=LengthDist.parse(output_len),
            prompts=load_prompts(prompts) if prompts is not None else (),
            # a fresh tag per run: a cache warmed by an earlier run must not answer either
            cache_bust=uuid.uuid4().hex[:8] if cache_bust else None,
        )
        settings = BenchSettings(
            base_url=base_url,
            api_key=api_key,
            options=RequestOptions(
                endpoint=endpoint,
                model=model,
                include_usage=usage,
                ignore_eos=ignore_eos,
                min_tokens=min_tokens,
                temperature=temperature,
                extra_body=parse_extra_body(extra_body),
            ),
            workload=workload,
            requests=DEFAULT_REQUESTS if requests is None and duration is None else requests,
            duration_s=duration,
            seed=seed,
            timeout_s=timeout,
        )
        if settings.requests is None and any(math.isinf(load.value) for load in loads):
            raise ValueError("an infinite rate (a burst) needs --requests")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    console = Console(stderr=True)
    progress = make_progress(console, disable=quiet)
    with progress:
        runs = asyncio.run(run_sweep(settings, loads, progress=progress))
    report = build_report(settings, runs)
    if not quiet:
        print_table(report, console)
    if output is not None:
        write_report(report, output)
        if not quiet:
            console.print(f"report written to {output}")
    else:
        typer.echo(json.dumps(report, indent=2))
    if plot is not None:
        from tokenyard.bench.plot import plot_sweep

        plot_sweep(report["levels"], plot, title=f"{model} · /{endpoint.value}")
        if not quiet:
            console.print(f"plot written to {plot}")
    if not any(level["requests"]["completed"] for level in report["levels"]):
        raise typer.Exit(1)
