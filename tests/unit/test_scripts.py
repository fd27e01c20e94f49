"""The Lua scripts' argument tables: flattening, the generated prologue, and the headers."""

from __future__ import annotations

import re
from importlib import resources
from typing import NamedTuple

import pytest

from tokenyard.broker.amqp import scripts as amqp_scripts
from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.keys import Keys
from tokenyard.broker.redis.scripts import SCRIPTS, Empty, ScriptSpec

# the Redis backend's scripts and those of RabbitMQ lanes' tables (their own lua/)
ALL = (*SCRIPTS, *amqp_scripts.SCRIPTS)


class Fixed(NamedTuple):
    first: str
    second: str


class ItemKeys(NamedTuple):
    lane: str


class ItemArgs(NamedTuple):
    entry_id: str
    event: bytes


SPEC = ScriptSpec("example", Fixed, Empty, ItemKeys, ItemArgs)


def lua(name: str, package: str = "tokenyard.broker.redis") -> str:
    return resources.files(package).joinpath(f"lua/{name}.lua").read_text()


def header(source: str) -> tuple[str, str]:
    """The KEYS and ARGV lines of a header comment, with their continuation lines joined."""
    found: dict[str, str] = {}
    current = None
    for line in source.splitlines():
        if not line.startswith("--"):
            break
        text = line[2:].strip()
        match = re.match(r"(KEYS|ARGV): (.*)", text)
        if match:
            current = match.group(1)
            found[current] = match.group(2)
        elif current is not None and line.startswith("--   "):
            found[current] += " " + text
        else:
            current = None
    return f"KEYS: {found['KEYS']}", f"ARGV: {found['ARGV']}"


def test_call_puts_fixed_values_first_then_each_item_in_order() -> None:
    name, keys, args = SPEC.call(
        Fixed("f1", "f2"),
        Empty(),
        [(ItemKeys("l1"), ItemArgs("1-0", b"a")), (ItemKeys("l2"), ItemArgs("2-0", b"b"))],
    )
    assert name == "example"
    assert keys == ["f1", "f2", "l1", "l2"]
    assert args == ["1-0", b"a", "2-0", b"b"]


def test_prologue_binds_each_name_to_its_position() -> None:
    prologue = SPEC.prologue()
    # locals, not tables (a table per call costs the server its allocation and its stores)
    assert "local K_first, K_second = KEYS[1], KEYS[2]" in prologue
    assert "local A_" not in prologue  # no fixed args: nothing bound
    assert "local N = (#KEYS - 2) / 1" in prologue
    assert "local k, a = 2 + (i - 1) * 1, 0 + (i - 1) * 2" in prologue
    assert "local t = {lane = KEYS[k + 1], entry_id = ARGV[a + 1], event = ARGV[a + 2]}" in prologue
    assert "return t, t" in prologue


def test_items_without_keys_are_counted_from_argv() -> None:
    spec = ScriptSpec("argv_only", Empty, Fixed, Empty, ItemArgs)
    assert "local N = (#ARGV - 2) / 2" in spec.prologue()


def test_an_items_keys_and_args_need_distinct_names() -> None:
    class Clash(NamedTuple):
        lane: str

    with pytest.raises(ValueError, match="distinct"):
        ScriptSpec("clash", Empty, Empty, ItemKeys, Clash)


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.id)
def test_each_header_comment_repeats_its_table(
    spec: ScriptSpec[Fixed, Empty, Empty, Empty],
) -> None:
    assert header(lua(spec.name, spec.package)) == spec.header()


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.id)
def test_script_bodies_use_declared_names_only(
    spec: ScriptSpec[Fixed, Empty, Empty, Empty],
) -> None:
    body = lua(spec.name, spec.package)
    assert "KEYS[" not in body and "ARGV[" not in body  # no positions: names only
    assert set(re.findall(r"\bK\.(\w+)", body)) <= set(spec.keys)
    assert set(re.findall(r"\bA\.(\w+)", body)) <= set(spec.args)
    assert set(re.findall(r"\bk\.(\w+)", body)) <= set(spec.item_keys)
    assert set(re.findall(r"\ba\.(\w+)", body)) <= set(spec.item_args)
    assert set(re.findall(r"item\(i\)\.(\w+)", body)) <= set(spec.item_keys)


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.id)
def test_the_source_reads_fixed_names_through_the_prologues_locals(
    spec: ScriptSpec[Fixed, Empty, Empty, Empty],
) -> None:
    """K.<name> / A.<name> in the body and its libraries become the prologue's locals; a name
    a library reads that this script does not declare would be an undefined global."""
    source = spec.source()
    assert not re.search(r"\b[KA]\.\w", source)
    assert set(re.findall(r"\bK_(\w+)", source)) <= set(spec.keys)
    assert set(re.findall(r"\bA_(\w+)", source)) <= set(spec.args)


@pytest.mark.parametrize("table", [SCRIPTS, amqp_scripts.SCRIPTS], ids=["redis", "amqp"])
def test_every_script_file_has_a_table(
    table: tuple[ScriptSpec[Fixed, Empty, Empty, Empty]],
) -> None:
    package = table[0].package
    files = {
        p.name.removesuffix(".lua")
        for p in resources.files(package).joinpath("lua").iterdir()
        if p.name.endswith(".lua")
    }
    assert files == {spec.name for spec in table}
    assert scripts.CLAIM.item_keys == ("lane",)


def _built_as_keys_py(lane: str, body: str, names: dict[str, str]) -> None:
    """Each key name keys.py gives is the lane plus the suffix the script appends, and the
    script appends it as written."""
    for name, built in names.items():
        assert name == lane + built.split("'")[1]
        assert built in body


def test_claim_names_a_lanes_keys_as_keys_py_does() -> None:
    """claim.lua is sent only the lane and builds the names that hang off it: the same names."""
    lane, body = "ty:{m}:lane:normal", lua("claim")
    names = {
        Keys.fair(lane): "lane .. ':fair'",
        Keys.fair_active(lane): "lane .. ':active'",
        Keys.affinity_held(lane): "lane .. ':affq'",
        Keys.tenant_queue_prefix(lane): "lane .. ':tq:'",
        Keys.affinity_worker_prefix(lane): "lk.lane .. ':affw:'",
        Keys.affinity_stream(lane): "lk.lane .. ':aff'",
    }
    _built_as_keys_py(lane, body, names)
    assert Keys.affinity_worker(lane, "w") == Keys.affinity_worker_prefix(lane) + "w"
    assert "affw_prefix .. consumer" in body


def test_enqueue_names_a_lanes_keys_as_keys_py_does() -> None:
    lane, body = "ty:{m}:lane:normal", lua("enqueue")
    assert scripts.ENQUEUE.item_keys == ("lane", "job", "idem", "inflight")
    names = {
        Keys.fair(lane): "k.lane .. ':fair'",
        Keys.fair_active(lane): "k.lane .. ':active'",
        Keys.affinity_held(lane): "k.lane .. ':affq'",
        Keys.tenant_queue_prefix(lane): "k.lane .. ':tq:'",
        Keys.affinity_worker_prefix(lane): "k.lane .. ':affw:'",
    }
    _built_as_keys_py(lane, body, names)
