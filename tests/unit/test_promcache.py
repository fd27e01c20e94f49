"""Cached metrics expose exactly what prometheus_client's own would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tokenyard.metrics.promcache import CachedHistogram


def test_observe_many_exposes_what_as_many_observes_do() -> None:
    exposed: list[list[str]] = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        histogram = CachedHistogram("gap_seconds", "gaps", ["model"], registry=registry)
        child = histogram.labels("m")
        for value, count in ((0.003, 7), (0.2, 1), (5.0, 3), (0.05, 0), (100.0, 2)):
            if bulk:
                child.observe_many(value, count)
            else:
                for _ in range(count):
                    child.observe(value)
        lines = generate_latest(registry).decode().splitlines()
        exposed.append([line for line in lines if "_created" not in line])  # a timestamp
    assert exposed[0] == exposed[1]
    assert 'gap_seconds_count{model="m"} 13.0' in exposed[1]
