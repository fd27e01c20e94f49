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


def test_observe_all_exposes_what_one_observe_each_does() -> None:
    # values on a bucket's bound, between bounds, past the last bound, zero, and none at all
    values = [0.0, 0.005, 0.0051, 0.1, 0.1, 2.5, 7.0, 99.0, 1e9, 0.02]
    exposed: list[list[str]] = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        histogram = CachedHistogram("wait_seconds", "waits", ["model"], registry=registry)
        child = histogram.labels("m")
        if bulk:
            child.observe_all(values)
            child.observe_all([])
        else:
            for value in values:
                child.observe(value)
        lines = generate_latest(registry).decode().splitlines()
        exposed.append([line for line in lines if "_created" not in line])
    assert exposed[0] == exposed[1]
    assert 'wait_seconds_count{model="m"} 10.0' in exposed[1]
    assert 'wait_seconds_bucket{le="0.005",model="m"} 2.0' in exposed[1]
