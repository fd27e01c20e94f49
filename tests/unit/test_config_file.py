"""Settings precedence: flag > environment > TOML file > default; errors name key and source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenyard.cli import app
from tokenyard.config import CONFIG_ENV, BrokerSettings, WorkerSettings, from_env
from tokenyard.errors import FatalError
from tokenyard.gateway.settings import gateway_settings


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "tokenyard.toml"
    path.write_text(
        "[broker]\nlease_s = 7.5\nprefix = 'file'\nmax_deliveries = 3\n"
        "[worker]\nengine = 'sim'\nmax_seqs = 4\n"
        "[gateway]\nmodels = ['a', 'b']\nport = 9001\n"
    )
    return path


def test_flag_beats_env_beats_file_beats_default(toml: Path) -> None:
    env = {CONFIG_ENV: str(toml), "TOKENYARD_BROKER_PREFIX": "env"}
    broker = from_env(BrokerSettings, "broker", env, lease_s=2.0)
    assert broker.lease_s == 2.0  # flag over file
    assert broker.prefix == "env"  # env over file
    assert broker.max_deliveries == 3  # file over default
    assert broker.max_queue_depth == BrokerSettings().max_queue_depth  # default
    gateway = gateway_settings({**env, "TOKENYARD_GATEWAY_PORT": "9002"})
    assert (gateway.models, gateway.port) == (("a", "b"), 9002)
    assert gateway_settings(env, models="x,y").models == ("x", "y")
    assert from_env(WorkerSettings, "worker", env).max_seqs == 4


def test_errors_name_the_setting_and_its_source(toml: Path, tmp_path: Path) -> None:
    env = {CONFIG_ENV: str(toml), "TOKENYARD_WORKER_MAX_SEQS": "lots"}
    with pytest.raises(FatalError, match=r"max_seqs = 'lots' \(from TOKENYARD_WORKER_MAX_SEQS\)"):
        from_env(WorkerSettings, "worker", env)
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker]\nlease_s = 'long'\n")
    with pytest.raises(FatalError, match=rf"lease_s = 'long' \(from file {bad}\)"):
        from_env(BrokerSettings, "broker", {CONFIG_ENV: str(bad)})
    bad.write_text("[broker]\nleese_s = 3\n")
    with pytest.raises(FatalError, match=rf"{bad}: unknown setting 'leese_s' in \[broker\]"):
        from_env(BrokerSettings, "broker", {CONFIG_ENV: str(bad)})
    bad.write_text("[broker\n")
    with pytest.raises(FatalError, match=rf"cannot read the config file {bad}"):
        from_env(BrokerSettings, "broker", {CONFIG_ENV: str(bad)})


def test_config_show_prints_values_and_sources(toml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CONFIG_ENV, "TOKENYARD_BROKER_PREFIX", "TOKENYARD_GATEWAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENYARD_GATEWAY_PORT", "9002")
    monkeypatch.setenv("TOKENYARD_WORKER_REMOTE_API_KEY", "sk-secret")
    # --config sets TOKENYARD_CONFIG for the process (and serve's workers); monkeypatch undoes it
    monkeypatch.setenv(CONFIG_ENV, "")
    result = CliRunner().invoke(app, ["--config", str(toml), "config", "show", "--json"])
    assert result.exit_code == 0, result.output
    shown = {
        section: {row["setting"]: (row["value"], row["source"]) for row in rows}
        for section, rows in json.loads(result.output).items()
    }
    assert shown["broker"]["lease_s"] == (7.5, f"file {toml}")
    assert shown["broker"]["url"] == ("", "default")  # no broker unless one is named
    assert shown["gateway"]["port"] == (9002, "TOKENYARD_GATEWAY_PORT")
    assert shown["gateway"]["models"] == (["a", "b"], f"file {toml}")
    assert shown["worker"]["remote_api_key"] == ("***", "TOKENYARD_WORKER_REMOTE_API_KEY")
    table = CliRunner().invoke(app, ["--config", str(toml), "config", "show"])
    assert table.exit_code == 0 and "[gateway]" in table.output


def test_invalid_values_and_unknown_tables_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONFIG_ENV, "")  # --config sets it for the process; monkeypatch undoes it
    bad = tmp_path / "bad.toml"
    for text, refusal in [
        ("[gateway]\nport = 99999\n", r"gateway setting port = 99999 \(from file"),
        ("[worker]\nmax_seqs = -4\n", r"worker setting max_seqs = -4 \(from file"),
        ("[autoscale]\nmin_workers = 1\n[workers]\nmax_seqs = 4\n", r"unknown table \[workers\]"),
    ]:
        bad.write_text(text)
        result = CliRunner().invoke(app, ["--config", str(bad), "config", "show", "--json"])
        assert isinstance(result.exception, FatalError), result.output
        assert re.search(refusal, str(result.exception)), result.exception
    with pytest.raises(FatalError, match=r"max_seqs = 0 \(from flag\)"):
        from_env(WorkerSettings, "worker", {}, max_seqs=0)


def test_config_show_shows_the_autoscale_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[autoscale]\nmax_workers = 7\n")
    monkeypatch.setenv(CONFIG_ENV, "")
    result = CliRunner().invoke(app, ["--config", str(good), "config", "show", "--json"])
    assert result.exit_code == 0, result.output
    shown = {row["setting"]: row for row in json.loads(result.output)["autoscale"]}
    assert (shown["max_workers"]["value"], shown["max_workers"]["source"]) == (7, f"file {good}")


def test_unknown_variables_are_warned_of_with_the_nearest_known_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tokenyard.cli.config import warn_unknown_variables

    for name in ("TOKENYARD_WORKER_MAX_SEQ", "TOKENYARD_GATEWAY_PROT", "TOKENYARD_ZZZ"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("TOKENYARD_WORKER_MAX_SEQS", "4")  # known: nothing said of it
    monkeypatch.delenv("TOKENYARD_LOG_NAME", raising=False)
    with caplog.at_level("WARNING", logger="tokenyard.config"):
        warn_unknown_variables()
    lines = {r.getMessage().split()[0]: r.getMessage() for r in caplog.records}
    assert set(lines) == {"TOKENYARD_WORKER_MAX_SEQ", "TOKENYARD_GATEWAY_PROT", "TOKENYARD_ZZZ"}
    assert lines["TOKENYARD_WORKER_MAX_SEQ"].endswith("did you mean TOKENYARD_WORKER_MAX_SEQS?")
    assert lines["TOKENYARD_GATEWAY_PROT"].endswith("did you mean TOKENYARD_GATEWAY_PORT?")
    assert "did you mean" not in lines["TOKENYARD_ZZZ"]
    # a worker serve started (it names it) leaves the warning to serve
    caplog.clear()
    monkeypatch.setenv("TOKENYARD_LOG_NAME", "worker-1")
    warn_unknown_variables()
    assert not caplog.records


def test_every_variable_the_code_reads_is_known() -> None:
    from tokenyard.cli.config import sections
    from tokenyard.config import OTHER_VARIABLES, setting_variables

    root = Path(__file__).resolve().parents[2]
    known = {*setting_variables(dict(sections())), *OTHER_VARIABLES}
    named = {
        name
        for folder in ("tokenyard", "tests")
        for source in (root / folder).rglob("*.py")
        for name in re.findall(r"TOKENYARD_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])", source.read_text())
    }
    # this file's misspelt examples (names written `TOKENYARD_WORKER_*` are families)
    made_up = {"TOKENYARD_WORKER_MAX_SEQ", "TOKENYARD_GATEWAY_PROT", "TOKENYARD_ZZZ"}
    assert named - known - made_up == set()


def test_serve_refuses_zero_workers_unless_autoscaling() -> None:
    from tokenyard.cli.autoscale import autoscale_config

    with pytest.raises(FatalError, match="--workers 0 starts no worker"):
        autoscale_config("0", None, None)
    assert autoscale_config("2", None, None) is None
    config = autoscale_config("auto", 0, 2)
    assert config is not None and config.scale_to_zero
