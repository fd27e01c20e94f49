"""Fleet simulation: the autoscaling policy against static fleets on a bursty trace.

Virtual clock, the sim engine's cost model (tokenyard/fleet/fleetsim.py); no processes, no Redis.
Prints JSON (p50/p99 queue time, worker-hours per fleet) and, with --plot, draws workers and
queue time over time. The report in docs/autoscaling.md came from:
    python -m bench.fleet_sim --plot docs/img/fleet_sim.png
and the 1,000-worker run from:
    python -m bench.fleet_sim --base 120 --peak 960 --max 1000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenyard.fleet.autoscale import AutoscaleConfig
from tokenyard.fleet.fleetsim import SimConfig, SimResult, bursty_trace, simulate, worker_capacity


def policy_config(
    args: argparse.Namespace, sim: SimConfig, utilization: float = 0.8
) -> AutoscaleConfig:
    return AutoscaleConfig(
        min_workers=max(1, args.base // 2),
        target_utilization=utilization,
        max_workers=args.max,
        slo_queue_s=args.slo_s,
        startup_s=sim.cold_start_s,
        up_cooldown_s=10,
        down_cooldown_s=30,
        down_window_s=60,
        max_down_step=max(1, args.peak // 8),
        tick_s=1.0,
        default_service_rate=worker_capacity(sim),
    )


def plot(results: list[SimResult], path: Path, title: str) -> Path:
    # as tokenyard/bench/plot.py: the Agg canvas directly, no pyplot state, no display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 7), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    rate_axis = top.twinx()
    first = results[0].series
    rate_axis.plot([s[0] for s in first], [s[1] for s in first], color="0.6", lw=1, ls="--")
    rate_axis.set_ylabel("arrivals (jobs/s, dashed)")
    for result in results:
        ts = [s[0] for s in result.series]
        top.plot(ts, [s[2] for s in result.series], label=result.label)
        bottom.plot(ts, [max(s[4], 1e-3) for s in result.series], label=result.label, lw=1)
    top.set_ylabel("workers (alive)")
    top.legend(loc="upper left")
    top.grid(True, alpha=0.3)
    bottom.set_yscale("log")
    bottom.set_ylabel("p99 queue time per second (s)")
    bottom.set_xlabel("virtual time (s)")
    bottom.grid(True, alpha=0.3)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=int, default=8, help="workers' worth of quiet traffic")
    p.add_argument("--peak", type=int, default=64, help="workers' worth of the spike")
    p.add_argument("--max", type=int, default=1000, help="the policy's most workers")
    p.add_argument("--slo-s", type=float, default=2.0, help="queue-time SLO of the policy")
    p.add_argument("--cold-start-s", type=float, default=20.0, help="worker start to first claim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    args = p.parse_args()
    sim = SimConfig(cold_start_s=args.cold_start_s, seed=args.seed)
    trace = bursty_trace(args.base, args.peak, sim)
    fleets = [
        ("static base", {"static_workers": args.base}),
        ("static peak", {"static_workers": args.peak}),
        ("policy, 80 % target", {"policy": policy_config(args, sim)}),
        ("policy, 60 % target", {"policy": policy_config(args, sim, 0.6)}),
    ]
    results = [simulate(trace, sim, label=label, **kw) for label, kw in fleets]  # type: ignore[arg-type]
    report = {
        "benchmark": "fleet_sim",
        "trace": [{"duration_s": ph.duration_s, "rate": round(ph.rate, 2)} for ph in trace],
        "worker_capacity_jobs_per_s": round(worker_capacity(sim), 3),
        "slots": sim.slots,
        "cold_start_s": sim.cold_start_s,
        "slo_queue_s": args.slo_s,
        "fleets": [r.summary() for r in results],
    }
    if args.plot is not None:
        title = (
            f"bursty trace {args.base} → {args.peak} workers' worth, "
            f"cold start {sim.cold_start_s:g} s"
        )
        report["plot"] = str(plot(results, args.plot, title))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
