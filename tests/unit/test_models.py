"""What `--model` names (engines/models.py): a local directory, `tiny`, or a Hugging Face hub
id resolved through huggingface_hub's cache (built here, as the hub lays it out, holding the tiny
model: the tests have no network); and the names a model is served under, which gateways and
workers derive by the same rule."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub import REPO, hub_cache
from tokenyard.config import WorkerSettings
from tokenyard.engines.models import is_hub_id, local_model, served_names
from tokenyard.errors import FatalError
from tokenyard.gateway.routing import RoutingRules
from tokenyard.gateway.settings import GatewaySettings, served_models
from tokenyard.worker.run import with_local_model

pytest.importorskip("huggingface_hub")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An offline hub cache holding the tiny model as REPO (main) and at tag `v1`.

    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at import, into `constants`,
    which it consults on every call: set there for this process (the CLI tests set the
    variables)."""
    from huggingface_hub import constants

    root = tmp_path / "hub"
    hub_cache(root, tag="v1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    yield root


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(cache: Path) -> None:
    storage = cache / f"models--{REPO.replace('/', '--')}"
    main = (storage / "refs" / "main").read_text()
    tagged = (storage / "refs" / "v1").read_text()
    assert main != tagged
    assert local_model(REPO) == str(storage / "snapshots" / main)
    assert local_model(REPO, "v1") == str(storage / "snapshots" / tagged)
    assert local_model(REPO, tagged) == str(storage / "snapshots" / tagged)  # a commit
    assert (Path(local_model(REPO)) / "config.json").is_file()


def test_what_the_cache_lacks_offline_is_one_line_saying_why(cache: Path) -> None:
    with pytest.raises(FatalError) as missing:
        local_model("nobody/none")
    line = str(missing.value)
    assert "\n" not in line
    assert "model nobody/none is neither a local directory nor in the Hugging Face cache" in line
    assert str(cache) in line and "HF_HUB_OFFLINE=1 forbids downloading it" in line
    with pytest.raises(FatalError, match=f"model {REPO} at revision v2 is neither"):
        local_model(REPO, "v2")


def test_a_tokenizer_alone_is_served_from_a_snapshot_without_weights(cache: Path) -> None:
    # what a gateway (or the remote engine) fetches: config and tokenizer, no weights
    hub_cache(cache, "org/no-weights", weights=False)
    snapshot = Path(local_model("org/no-weights", weights=False))
    assert (snapshot / "tokenizer.json").is_file() and not (snapshot / "model.safetensors").exists()
    with pytest.raises(FatalError) as engine:  # an engine needs them: not there, not fetchable
        local_model("org/no-weights")
    assert str(engine.value) == (
        "model org/no-weights: its cached snapshot misses files and the hub could not be "
        "reached to fetch them"
    )
    # the gateway's tokenizer and the worker's remote engine ask for the tokenizer only
    from tokenyard.gateway.tokenizers import load_tokenizer

    assert load_tokenizer("hf", "org/no-weights").encode("the yard")
    remote = with_local_model(WorkerSettings(model="org/no-weights", engine="remote"))
    assert remote.model == str(snapshot)


def test_an_unreachable_hub_falls_back_to_the_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    with socket.socket() as held:  # a port nobody answers on
        held.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{held.getsockname()[1]}"
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        assert Path(local_model(REPO)).parent.name == "snapshots"
        with pytest.raises(FatalError) as missing:
            local_model("nobody/none")
    assert f"the hub ({endpoint}) could not be reached to download it" in str(missing.value)


def test_local_directories_and_tiny_are_taken_as_given(tmp_path: Path) -> None:
    assert local_model("tiny") == "tiny" and local_model("tiny-tools") == "tiny-tools"
    assert local_model(str(tmp_path)) == str(tmp_path)
    # not a directory, and not shaped as a hub id either: no hub is asked
    for path in (str(tmp_path / "gone"), "./models/gone", "../gone"):
        with pytest.raises(FatalError, match=r"model directory .*gone does not exist"):
            local_model(path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id("a/b/c") and not is_hub_id("./a") and not is_hub_id("a--b/c")


def test_a_worker_loads_the_snapshot_under_the_name_it_was_given(cache: Path) -> None:
    named = with_local_model(WorkerSettings(model=REPO, engine="hf"))
    assert named.model == local_model(REPO) and named.served_model_name == (REPO,)
    aliased = with_local_model(
        WorkerSettings(model=REPO, engine="hf", served_model_name=("tiny,yard", "tiny"))
    )
    assert aliased.served_model_name == ("tiny", "yard")
    # the sim engine loads nothing: its model is only a name, never looked up
    sim = with_local_model(WorkerSettings(model="nobody/none", engine="sim"))
    assert (sim.model, sim.served_model_name) == ("nobody/none", ("nobody/none",))


def test_a_gateway_serves_one_model_under_its_names() -> None:
    assert served_names("org/m") == ("org/m",)
    served = served_models(
        GatewaySettings(models=("org/m",), served_model_name=("m", "alias", "m"), revision="r")
    )
    assert served.models == ("m",) and served.sources == {"m": "org/m"}
    assert served.aliases == {"alias": "m"} and served.names == ("m", "alias")
    assert served.revision == "r"
    plain = served_models(GatewaySettings(models=("a", "b")))
    assert plain.models == ("a", "b") and plain.aliases == {}
    with pytest.raises(FatalError, match="--served-model-name and --revision name one model"):
        served_models(GatewaySettings(models=("a", "b"), served_model_name=("x",)))
    # a routing file's alias may not name a served name otherwise
    with pytest.raises(
        FatalError, match=r"routing aliases are served model names too: \['alias'\]"
    ):
        RoutingRules(aliases={"alias": "b"}).with_served_names(served.aliases)
