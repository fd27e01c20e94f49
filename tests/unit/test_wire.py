"""Wire format, key naming and settings."""

from __future__ import annotations

import pytest

from tokenyard.broker.ids import model_tag, new_job_id, tag_of_job
from tokenyard.broker.redis.keys import Keys
from tokenyard.config import BrokerSettings, from_env
from tokenyard.errors import FatalError
from tokenyard.messages import (
    WIRE_VERSION,
    Finished,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    TokenChunk,
    decode,
    decode_event,
    encode,
)


def test_job_spec_round_trips_through_msgpack_with_its_version() -> None:
    spec = JobSpec(
        id=new_job_id("m"),
        model="m",
        prompt="héllo",
        prompt_token_ids=[1, 2, 3],
        priority=Priority.HIGH,
        sampling=SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=3, stop=("x",)),
        deadline=123.5,
        trace_context={"traceparent": "00-abc-def-01"},
    )
    raw = encode(spec)
    assert b"\x80\x04" not in raw[:2]  # not a pickle protocol header
    back = decode(raw, JobSpec)
    assert back == spec and back.v == WIRE_VERSION


def test_a_spec_leaves_its_defaults_off_the_wire_and_reads_them_back() -> None:
    """Every script copies a job's spec and every worker decodes it: fields at their defaults
    (the version among them) are not written, and come back as they were."""
    spec = JobSpec(id="j1", model="m", prompt="hi", sampling=SamplingParams(max_tokens=4))
    raw = encode(spec)
    for name in (b"tenant", b"temperature", b"presence_penalty", b"logit_bias", b"v"):
        assert msgpack_key(name) not in raw
    back = decode(raw, JobSpec)
    assert back == spec and back.v == WIRE_VERSION and back.sampling.temperature == 1.0
    # a value away from its default is written, and read back
    moved = JobSpec(id="j1", model="m", attempt=2, sampling=SamplingParams(temperature=0.0))
    assert decode(encode(moved), JobSpec) == moved and msgpack_key(b"attempt") in encode(moved)


def msgpack_key(name: bytes) -> bytes:
    """A short map key as msgpack writes it (fixstr)."""
    return bytes([0xA0 | len(name)]) + name


def test_events_are_tagged_unions() -> None:
    chunk = TokenChunk(token_ids=[5], text="a")
    done = Finished(result=JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP))
    assert decode_event(encode(chunk)) == chunk
    assert decode_event(encode(done)) == done


def test_status_terminality() -> None:
    assert not JobStatus.QUEUED.terminal and not JobStatus.RUNNING.terminal
    assert all(s.terminal for s in JobStatus if s not in (JobStatus.QUEUED, JobStatus.RUNNING))


def test_keys_of_a_model_share_one_hash_tag() -> None:
    keys = Keys("ty")
    job_id = new_job_id("llama-3")
    tag = "{" + model_tag("llama-3") + "}"
    names = [
        *keys.lanes("llama-3"),
        keys.job(job_id),
        keys.events(job_id),
        keys.delayed("llama-3"),
        keys.dead_letters("llama-3"),
        keys.idempotency("llama-3", "acme", "k"),
        keys.cancels_of_job(job_id),
    ]
    assert all(name.startswith("ty:" + tag) for name in names)
    assert keys.cancels_of_job(job_id) == keys.cancels("llama-3")
    assert tag_of_job(job_id) == model_tag("llama-3")
    with pytest.raises(ValueError):
        tag_of_job("nonsense")


def test_settings_from_env_with_overrides_and_fail_fast() -> None:
    env = {"TOKENYARD_BROKER_LEASE_S": "2.5", "TOKENYARD_BROKER_MAX_DELIVERIES": "9"}
    settings = from_env(BrokerSettings, "broker", env, max_deliveries=3)
    assert settings.lease_s == 2.5 and settings.max_deliveries == 3
    with pytest.raises(FatalError):
        from_env(BrokerSettings, "broker", {"TOKENYARD_BROKER_LEASE_S": "soon"})
