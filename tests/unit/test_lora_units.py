"""LoRA adapters' pure parts: the wire (old messages still decode), --lora parsing, the
gateway's adapter book, the affinity key, and the CLI over a real Valkey."""

from __future__ import annotations

import msgspec
import pytest

from tokenyard.engines.base import EngineRequest
from tokenyard.engines.models import parse_loras
from tokenyard.errors import FatalError
from tokenyard.gateway.adapters import AdapterBook, answered_model
from tokenyard.gateway.admission import _affinity_key
from tokenyard.messages import AdapterRecord, JobSpec, SamplingParams, decode, encode
from tokenyard.worker.worker import adapter_records


class _OldJobSpec(msgspec.Struct, kw_only=True):
    """A JobSpec as written before adapters existed (its fields up to `pooling`)."""

    id: str
    model: str
    prompt_token_ids: list[int] | None = None


def test_old_messages_decode_as_the_base_model() -> None:
    spec = decode(encode(_OldJobSpec(id="j1", model="tiny", prompt_token_ids=[1])), JobSpec)
    assert spec.adapter == "" and spec.adapter_path == ""
    old = msgspec.msgpack.encode(["s", [1, 2], SamplingParams(), [], 1, None, None])
    request = msgspec.msgpack.decode(old, type=EngineRequest)
    assert request.adapter is None and request.adapter_path == ""
    spec = JobSpec(id="j2", model="tiny", adapter="sql", adapter_path="/l/sql")
    assert decode(encode(spec), JobSpec).adapter == "sql"
    assert answered_model(spec) == "sql" and answered_model(JobSpec(id="j", model="m")) == "m"


def test_lora_flags_parse_and_refuse_bad_entries(tmp_path: object) -> None:
    assert parse_loras(["sql=/a/b", " chat = org/x "]) == {"sql": "/a/b", "chat": "org/x"}
    for bad in (["sql"], ["=x"], ["sql="], ["a=1", "a=2"]):
        with pytest.raises(FatalError):
            parse_loras(bad)
    records = adapter_records(("hub=org/not-local",), "tiny", 5.0)
    assert records == [AdapterRecord(name="hub", base="tiny", path="org/not-local", created_at=5.0)]


def test_an_adapters_jobs_share_one_affinity_key_apart_from_prefixes() -> None:
    sql = AdapterRecord(name="sql", base="tiny", path="p")
    chat = AdapterRecord(name="chat", base="tiny", path="p")
    assert _affinity_key("prefix1", None) == "prefix1"
    assert _affinity_key("prefix1", sql) == _affinity_key("prefix2", sql) == _affinity_key("", sql)
    assert _affinity_key("prefix1", sql) != _affinity_key("prefix1", chat)
    assert _affinity_key("prefix1", sql) not in ("", "prefix1")


class _Directory:
    def __init__(self) -> None:
        self.records: list[AdapterRecord] = []
        self.reads = 0

    async def adapters(self) -> list[AdapterRecord]:
        self.reads += 1
        return list(self.records)


async def test_the_book_reads_at_most_every_ttl_and_at_once_for_a_new_name() -> None:
    now = [0.0]
    directory = _Directory()
    directory.records = [
        AdapterRecord(name="sql", base="tiny", path="p"),
        AdapterRecord(name="other", base="not-served", path="p"),
    ]
    book = AdapterBook(directory, ["tiny"], ttl_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert list(await book.all()) == ["sql"]  # another gateway's base is not listed here
    assert (await book.find("sql")) is not None and directory.reads == 1
    directory.records.append(AdapterRecord(name="new", base="tiny", path="p"))
    now[0] = 0.1
    assert await book.find("new") is None  # read 0.1 s ago: not again so soon
    now[0] = 0.3
    assert await book.find("new") is not None  # a miss reads anew (a just-added adapter)
    assert directory.reads == 2
    await book.find("sql")
    assert directory.reads == 2  # a hit within the TTL reads nothing


def test_an_adapter_on_an_engine_that_runs_none_is_refused_at_admission_by_name() -> None:
    from tokenyard import limits
    from tokenyard.engines.sim import SimEngine

    sim = SimEngine().limits()  # runs no adapters, and says so in the limits it publishes
    assert not sim.adapters
    params = SamplingParams(max_tokens=4)
    assert limits.refusal(3, params, sim) is None  # the base runs
    refused = limits.refusal(3, params, sim, adapter="sql")
    assert refused is not None and refused.param == "model"
    assert refused.code == "unsupported_parameter" and "'sql' is a LoRA adapter" in str(refused)
    runs = msgspec.structs.replace(sim, adapters=True)
    assert limits.refusal(3, params, runs, adapter="sql") is None
