"""`tokenyard batch submit | status | results | cancel`: the Batches API from a terminal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from tokenyard.cli.options import gateway_target

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console(stderr=True)

UrlOpt = Annotated[
    str | None,
    typer.Option(
        help="gateway base URL; default: TOKENYARD_GATEWAY_HOST/_PORT, else the local serve's, "
        "else http://127.0.0.1:8000"
    ),
]
KeyOpt = Annotated[str | None, typer.Option(envvar="TOKENYARD_API_KEY", help="API key")]
_TERMINAL = ("completed", "failed", "expired", "cancelled")


def _client(url: str | None, api_key: str | None) -> httpx.Client:
    """A client of the gateway `url` names, else the one the other commands find
    (`cli/options.py` `gateway_target`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=gateway_target(url).url, headers=headers, timeout=60.0)


def _ok(response: httpx.Response) -> Any:
    """The JSON of a success; an API error is printed and exits 1."""
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        console.print(f"[red]error {response.status_code}:[/red] {message}")
        raise typer.Exit(1)
    return response.json()


def _endpoint_of(data: bytes) -> str:
    for line in data.splitlines():
        if line.strip():
            try:
                url = json.loads(line).get("url")
            except (ValueError, AttributeError):
                break
            if isinstance(url, str):
                return url
            break
    return "/v1/chat/completions"


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="JSONL of {custom_id, method, url, body}")],
    wait: Annotated[bool, typer.Option(help="follow progress until the batch ends")] = False,
    endpoint: Annotated[str | None, typer.Option(help="default: the first line's url")] = None,
    metadata: Annotated[list[str] | None, typer.Option(help="key=value, repeatable")] = None,
    output: Annotated[Path | None, typer.Option(help="with --wait: save results here")] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Upload FILE and create a batch; --wait follows it and fails unless it completes."""
    data = file.read_bytes()
    meta = dict(m.split("=", 1) for m in metadata or [])
    with _client(url, api_key) as http:
        up = _ok(
            http.post("/v1/files", files={"file": (file.name, data)}, data={"purpose": "batch"})
        )
        batch = _ok(
            http.post(
                "/v1/batches",
                json={
                    "input_file_id": up["id"],
                    "endpoint": endpoint or _endpoint_of(data),
                    "completion_window": "24h",
                    "metadata": meta or None,
                },
            )
        )
        print(batch["id"])
        if not wait:
            return
        final = follow(http, batch["id"])
        _print_status(final)
        if output is not None and final.get("output_file_id"):
            output.write_bytes(http.get(f"/v1/files/{final['output_file_id']}/content").content)
        if final["status"] != "completed":
            raise typer.Exit(1)


def follow(http: httpx.Client, batch_id: str, poll_s: float = 0.5) -> Any:
    """Poll the batch with a progress bar (done, failed, remaining, tokens/s, ETA)."""
    columns = (
        TextColumn("[bold]{task.fields[status]}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("done {task.fields[done]} · failed {task.fields[failed]}"),
        TextColumn("· left {task.fields[left]} · {task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
    )
    started = time.monotonic()
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("batch", total=None, status="", done=0, failed=0, left="?", tps="-")
        while True:
            batch = _ok(http.get(f"/v1/batches/{batch_id}"))
            counts = batch["request_counts"]
            done, failed, total = counts["completed"], counts["failed"], counts["total"]
            tokens = (batch.get("usage") or {}).get("output_tokens", 0)
            elapsed = max(time.monotonic() - started, 1e-9)
            bar.update(
                task,
                total=total or None,
                completed=done + failed,
                status=batch["status"],
                done=done,
                failed=failed,
                left=max(total - done - failed, 0) if total else "?",
                tps=f"{tokens / elapsed:.0f}",
            )
            if batch["status"] in _TERMINAL:
                return batch
            time.sleep(poll_s)


def _print_status(batch: Any) -> None:
    table = Table(title=batch["id"], show_header=False)
    counts = batch["request_counts"]
    rows = [
        ("status", batch["status"]),
        ("endpoint", batch["endpoint"]),
        ("requests", f"{counts['completed']} completed, {counts['failed']} failed "
         f"of {counts['total']}"),
        ("output file", batch.get("output_file_id") or "-"),
        ("error file", batch.get("error_file_id") or "-"),
    ]  # fmt: skip
    for error in ((batch.get("errors") or {}).get("data") or [])[:20]:
        rows.append((f"line {error.get('line')}", f"{error['code']}: {error['message']}"))
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)


@app.command()
def status(
    batch_id: str, url: UrlOpt = None, api_key: KeyOpt = None, as_json: bool = False
) -> None:
    """Show a batch (--as-json: OpenAI's batch object)."""
    with _client(url, api_key) as http:
        batch = _ok(http.get(f"/v1/batches/{batch_id}"))
    if as_json:
        print(json.dumps(batch, indent=2))
    else:
        _print_status(batch)


@app.command()
def results(
    batch_id: str,
    errors: Annotated[bool, typer.Option(help="the error file instead of the output")] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Write a batch's output (or error) file, one JSON line per request, to stdout."""
    with _client(url, api_key) as http:
        batch = _ok(http.get(f"/v1/batches/{batch_id}"))
        file_id = batch.get("error_file_id" if errors else "output_file_id")
        if not file_id:
            console.print(f"no {'error' if errors else 'output'} file (status {batch['status']})")
            raise typer.Exit(1)
        response = http.get(f"/v1/files/{file_id}/content")
        if response.status_code >= 400:
            _ok(response)
        sys.stdout.buffer.write(response.content)


@app.command()
def cancel(batch_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Cancel a batch: queued requests never run, the output keeps what completed."""
    with _client(url, api_key) as http:
        batch = _ok(http.post(f"/v1/batches/{batch_id}/cancel"))
    print(batch["status"])
