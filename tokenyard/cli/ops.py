"""`tokenyard dlq list|requeue` and `tokenyard drain WORKER`: operators' actions on the broker
(the dashboard's buttons do the same through the gateway's admin routes)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer

from tokenyard.broker import Backend, admin
from tokenyard.cli.options import BrokerOpt, PrefixOpt, with_broker
from tokenyard.errors import QueueFull, TokenyardError

dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters: list them, requeue them.")
ModelsOpt = Annotated[list[str] | None, typer.Option("--model", help="models to list; default all")]


@dlq_app.command("list")
def dlq_list(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: ModelsOpt = None,
    limit: Annotated[int, typer.Option(min=1, help="entries per model")] = 100,
) -> None:
    """Dead letters per model: job, reason, error, deliveries, and the job a requeue made."""
    with_broker(broker, prefix, lambda b: _list(b, model or [], limit))


async def _list(broker: Backend, models: list[str], limit: int) -> None:
    # tab-separated, a line each: fit for grep, cut and `column -t`
    rows = []
    for name in models or await broker.queue.models():
        for d in await admin.dead_letters(broker.queue, name, limit):
            e = d.entry
            at = datetime.fromtimestamp(e.at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            error = (e.error or "").replace("\t", " ").replace("\n", " ")
            rows.append(
                [e.job_id, e.model, e.reason, str(e.deliveries), at, d.requeued_as or "-", error]
            )
    if not rows:
        print("no dead letters")
        return
    for row in [["job", "model", "reason", "deliveries", "at", "requeued_as", "error"], *rows]:
        print("\t".join(row))


@dlq_app.command("requeue")
def dlq_requeue(
    job_ids: Annotated[list[str], typer.Argument(help="dead jobs' ids", metavar="JOB_ID...")],
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Queue dead jobs again, each as a new job of the same request; prints `old -> new`.
    Exit 1 if any is not a dead job (the others are still requeued)."""
    with_broker(broker, prefix, lambda b: _requeue(b, job_ids))


async def _requeue(broker: Backend, job_ids: list[str]) -> None:
    failed = []
    for job_id in job_ids:
        try:
            done = await admin.requeue_dead(broker.queue, job_id)
        except QueueFull as exc:
            failed.append(f"{job_id}: not requeued, {exc}")
            continue
        match done.outcome:
            case admin.RequeueOutcome.REQUEUED:
                print(f"{job_id} -> {done.requeued_as}")
            case admin.RequeueOutcome.ALREADY_REQUEUED:
                print(f"{job_id} -> {done.requeued_as} (requeued before)")
            case admin.RequeueOutcome.NOT_DEAD:
                failed.append(f"{job_id} is {done.status}, not a dead letter")
            case admin.RequeueOutcome.NOT_FOUND:
                failed.append(f"no job {job_id} (or its record lapsed)")
    if failed:
        # main() prints it as every command's failure: one line, exit 1
        raise TokenyardError("; ".join(failed))


def drain(
    worker: Annotated[str, typer.Argument(help="the worker's name, as `tokenyard status` shows")],
    model: Annotated[str | None, typer.Option(help="its model; default: look in all")] = None,
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Ask a live worker to drain, as SIGTERM does: it stops claiming, finishes or hands back
    its jobs, and exits (at its next heartbeat)."""
    with_broker(broker, prefix, lambda b: _drain(b, worker, model))


async def _drain(broker: Backend, worker: str, model: str | None) -> None:
    models = [model] if model else await broker.queue.models()
    found = await admin.drain_worker(broker.registry, models, worker)
    if found is None:
        raise TokenyardError(
            f"no live worker named {worker!r}" + (f" for model {model!r}" if model else "")
        )
    print(f"draining {worker} (model {found})")
