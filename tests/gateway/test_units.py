"""Pure pieces of the gateway: settings, keys, limits, abandonment."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tokenyard.broker.core import CancelOutcome
from tokenyard.errors import FatalError, InvalidRequest
from tokenyard.gateway import gateway_settings
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.limits import resolve_max_tokens
from tokenyard.gateway.live import Abandonment
from tokenyard.limits import check, refusal
from tokenyard.messages import ModelLimits, Priority, SamplingParams


def test_settings_from_environment() -> None:
    env = {"TOKENYARD_GATEWAY_MODELS": "tiny, other", "TOKENYARD_GATEWAY_PORT": "9001"}
    settings = gateway_settings(env, max_tokens_cap=64)
    assert settings.models == ("tiny", "other")
    assert (settings.port, settings.max_tokens_cap) == (9001, 64)
    with pytest.raises(FatalError):
        gateway_settings({"TOKENYARD_GATEWAY_PORT": "many"})


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps({"sk-a": {"tenant": "acme", "priority": "high"}, "sk-b": {"tenant": "bob"}})
    )
    ring = KeyRing.from_file(str(path))
    assert ring.tenant_for("Bearer sk-a") == Tenant("acme", Priority.HIGH)
    assert ring.tenant_for("bearer  sk-b ") == Tenant("bob", Priority.NORMAL)
    with pytest.raises(ApiError) as wrong:
        ring.tenant_for("Bearer sk-c")
    assert wrong.value.status == 401
    assert KeyRing.from_file("").tenant_for(None).name == "default"
    path.write_text(json.dumps({"sk-a": {"tenant": "acme", "priority": "urgent"}}))
    with pytest.raises(FatalError):
        KeyRing.from_file(str(path))
    with pytest.raises(FatalError):
        KeyRing.from_file(str(tmp_path / "missing.json"))


def test_max_tokens_resolution() -> None:
    limits = ModelLimits(max_model_len=20, max_seqs=1, token_budget=20)

    def resolve(requested: int | None, prompt: int) -> int:
        # the default and the cap are the gateway's; whether it fits is the one limits rule
        max_tokens = resolve_max_tokens(requested, 16, 100, prompt_tokens=prompt, context=20)
        check(refusal(prompt, SamplingParams(max_tokens=max_tokens), limits))
        return max_tokens

    assert resolve(None, 10) == 10
    assert resolve(5, 10) == 5
    for requested, prompt, code in (
        (101, 1, "max_tokens_exceeded"),
        (11, 10, "context_length_exceeded"),
        (None, 20, "context_length_exceeded"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            resolve(requested, prompt)
        assert refused.value.code == code


class _Broker:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, job_id: str) -> CancelOutcome:
        self.cancelled.append(job_id)
        return CancelOutcome.SIGNALLED

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self.cancel(job_id)  # one follower each: leaving cancels


async def test_abandoned_jobs_wait_out_the_grace_unless_a_reader_returns() -> None:
    broker = _Broker()
    abandon = Abandonment(broker, grace_s=0.05)  # type: ignore[arg-type]
    for job in ("left", "back", "async"):
        if job != "async":
            abandon.own(job)
        abandon.attach(job)
        await abandon.detach(job, finished=False)
    abandon.attach("back")  # a reconnect within the grace keeps the job
    await asyncio.sleep(0.15)
    assert broker.cancelled == ["left"]
    await abandon.detach("back", finished=True)
    abandon.own("now")
    abandon.attach("now")
    await abandon.detach("now", finished=False, grace=False)
    assert broker.cancelled == ["left", "now"]
    abandon.own("pending")
    abandon.attach("pending")
    await abandon.detach("pending", finished=False)
    await abandon.close()  # shutdown cancels what was waiting out its grace
    assert broker.cancelled[-1] == "pending"
