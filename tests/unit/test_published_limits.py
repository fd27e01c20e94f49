"""The gateway's view of its workers' limits and weights revision (a real Valkey, injected
clock): the revision keys the response cache and collapsing, so a heartbeat that lapses for a
moment must not turn them off, while a worker with other weights must."""

from __future__ import annotations

from tests.conftest import BackendFactory
from tokenyard.engines.sim import SimTokenizer
from tokenyard.gateway.limits import PublishedLimits
from tokenyard.messages import ModelLimits, WorkerInfo

MODEL = "m"


def beat(consumer: str, revision: str) -> WorkerInfo:
    limits = ModelLimits(max_model_len=512, max_seqs=4, token_budget=2048, revision=revision)
    return WorkerInfo(
        consumer=consumer,
        model=MODEL,
        engine="sim",
        host="h",
        pid=1,
        started_at=0.0,
        limits=limits,
    )


async def test_revision_outlives_a_lapsed_heartbeat_until_other_weights_show(
    make_backend: BackendFactory,
) -> None:
    now = [0.0]
    broker = make_backend(clock=lambda: now[0])
    limits = PublishedLimits(broker.registry, ttl_s=1.0, clock=lambda: now[0])
    tokenizer = SimTokenizer()

    unknown = await limits.of(MODEL, tokenizer)
    assert limits.revision(MODEL) is None  # no worker ever seen: nothing is cached
    # nor is anything refused that a worker may run: an adapter named before the first beat
    # (a worker that lists its adapters as it starts) is its worker's to judge
    assert unknown.adapters and unknown.embeds and unknown.scores

    await broker.registry.heartbeat(beat("w1", "r1"), ttl_s=2.0)
    now[0] = 1.0  # the cached read (no workers) is stale now
    assert (await limits.of(MODEL, tokenizer)).max_seqs == 4
    assert limits.revision(MODEL) == "r1"

    now[0] = 2.5  # w1's heartbeat lapsed: limits fall back to the tokenizer, revision stays
    assert (await limits.of(MODEL, tokenizer)).max_seqs == 1
    assert limits.revision(MODEL) == "r1"

    await broker.registry.heartbeat(beat("w2", "r2"), ttl_s=10.0)
    now[0] = 4.0
    await limits.of(MODEL, tokenizer)
    assert limits.revision(MODEL) == "r2"

    await broker.registry.heartbeat(beat("w3", "r3"), ttl_s=10.0)  # a rollout: two revisions live
    now[0] = 5.5
    await limits.of(MODEL, tokenizer)
    assert limits.revision(MODEL) is None
