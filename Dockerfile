# tokenyard's image: gateway, worker, autoscale and the CLI in one (the command picks the role).
#   docker build -t tokenyard:cpu .                                  # CPU-only torch, python:3.11-slim
#   docker build -t tokenyard:cuda --build-arg VARIANT=cuda .        # CUDA torch on nvidia/cuda
# Models are mounted at /models (read-only is fine): TOKENYARD_WORKER_MODEL=/models/<dir>.
# The install steps are deploy/docker/install.sh, which `make test-deploy` runs in a fresh venv.
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS base-cpu
# the CPU-only wheel: PyPI's default Linux torch is the CUDA build (several GB of nvidia-*)
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu 24.04's Python is 3.12; tokenyard needs >= 3.11. Torch from PyPI: the CUDA build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX=

# hadolint ignore=DL3006
FROM base-${VARIANT} AS build
ARG TORCH=torch==2.13.0
ARG EXTRAS=hf
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tokenyard ./tokenyard
COPY deploy/docker/install.sh /usr/local/bin/tokenyard-install
RUN VENV=/opt/tokenyard TORCH="${TORCH}" EXTRAS="${EXTRAS}" SRC=/src tokenyard-install

# hadolint ignore=DL3006
FROM base-${VARIANT}
COPY --from=build /opt/tokenyard /opt/tokenyard
COPY deploy/docker/healthcheck.sh /usr/local/bin/tokenyard-healthcheck
RUN useradd --create-home --uid 10001 --user-group tokenyard \
    && mkdir -p /models /data \
    && chown tokenyard:tokenyard /models /data
# TOKENYARD_* is the settings' prefix, no secret: in a container the gateway listens on all addresses
# hadolint ignore=DL3064
ENV PATH=/opt/tokenyard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENYARD_GATEWAY_HOST=0.0.0.0 \
    TOKENYARD_GATEWAY_FILES_DIR=/data/files
USER 10001:10001
WORKDIR /data
VOLUME ["/models", "/data"]
# 8000: the gateway (API, /metrics, /dashboard); 9100: a worker's --metrics-port; 9105: autoscale
EXPOSE 8000 9100 9105
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["tokenyard-healthcheck"]
ENTRYPOINT ["tokenyard"]
CMD ["gateway"]
