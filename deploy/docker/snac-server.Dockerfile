# syntax=docker/dockerfile:1.7
# snac-server: PyTorch with CUDA; the same image runs on CPU (--device cpu), so both profiles use it.
#   docker build -f deploy/docker/snac-server.Dockerfile -t REGISTRY/orpheus-megapod/snac-server:0.1.0 .
# One stage, as llm-server-cpu.Dockerfile says why: the virtualenv is installed where it runs. The
# decoder is plain PyTorch plus CUDA Graphs: no Triton, no compiler needed at run time.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The steps up to torch's are the CPU LLM image's too: one build reuses the other's layers.
RUN groupadd --gid 10001 megapod \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megapod
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_VERSION=2.13.0
# Where pip looks: PyPI, for torch too. A builder with no route to it sets both to a mirror
# (deploy/images/build_and_run.py serves one on loopback; deploy/README.md). Build arguments only:
# no ENV carries them into the image's configuration.
ARG PIP_INDEX_URL=https://pypi.org/simple
# PyPI's Linux torch wheel is the CUDA build; its CUDA libraries arrive as nvidia-* wheels, and the
# node's driver comes in through the NVIDIA container runtime. An index of CPU builds instead
# (https://download.pytorch.org/whl/cpu) gives a smaller image that runs on CPUs only.
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml ./
# The dependencies in a layer of their own, installed over empty packages: a change to the sources
# (README.md, pyproject's readme, included) rebuilds only the last steps below, not this one.
RUN for p in codec_contract orpheus_common orpheus_front snac_server llm_server megapod; do mkdir -p $p && touch $p/__init__.py; done \
 && touch README.md \
 && echo "torch==${TORCH_VERSION}" > /tmp/keep.txt \
 && pip install --constraint /tmp/keep.txt . \
 && pip uninstall -y orpheus-megapod \
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
EXPOSE 50051 9091
# Flags or SNAC_* variables configure it (snac-server --help); the chart sets the variables.
ENTRYPOINT ["snac-server"]
