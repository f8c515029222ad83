# syntax=docker/dockerfile:1.7
# llm-server, CUDA: vLLM's release image plus this project's package.
#   docker build -f deploy/docker/llm-server.Dockerfile -t REGISTRY/orpheus-megapod/llm-server:0.1.0-cuda .
# The build context is the repository root. For production, pin the base images by digest too
# (vllm/vllm-openai:v0.33.0@sha256:...): a tag can be re-pushed.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# Stage 1: this project's wheel (pure Python). setuptools and pip's build machinery stay here.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY codec_contract ./codec_contract
COPY orpheus_common ./orpheus_common
COPY orpheus_front ./orpheus_front
COPY snac_server ./snac_server
COPY llm_server ./llm_server
COPY megapod ./megapod
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the runtime. vLLM 0.33.0 (pyproject's `gpu` extra), PyTorch and the CUDA libraries are
# the base image's, pinned by its tag; this stage adds the wheel and its pure-Python dependencies
# and installs no compiler or build tool.
FROM ${VLLM_IMAGE}
COPY --from=wheel /wheels /tmp/wheels
COPY deploy/docker/cuda-pins.txt /tmp/cuda-pins.txt
# Keep the base image's vllm and torch exactly: a dependency that wanted others fails the build
# instead of swapping the engine underneath. FlashInfer's cubins (TRT-LLM attention kernels) go in
# at exactly FlashInfer's version, checked, so nothing is downloaded when a pod starts.
RUN python3 -m pip freeze | grep -E '^(vllm|torch)==' > /tmp/keep.txt \
 && python3 -m pip install --no-cache-dir --constraint /tmp/keep.txt --constraint /tmp/cuda-pins.txt \
      --extra-index-url https://flashinfer.ai/whl/ /tmp/wheels/*.whl vllm flashinfer-python flashinfer-cubin \
 && python3 -c "from importlib.metadata import version as v; assert v('flashinfer-cubin') == v('flashinfer-python'), (v('flashinfer-cubin'), v('flashinfer-python'))" \
 && rm -rf /tmp/wheels /tmp/keep.txt /tmp/cuda-pins.txt \
 && groupadd --gid 10001 megapod \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megapod
ENV HOME=/tmp PYTHONUNBUFFERED=1 HF_HOME=/cache/huggingface
USER 10001:10001
EXPOSE 8000
# Flags or ORPHEUS_* variables configure it (llm-server --help); the chart sets the variables.
ENTRYPOINT ["llm-server"]
