# syntax=docker/dockerfile:1.7
# The front (orpheus_front): the MegaPod's one endpoint before the LLM workers. No torch, no vLLM:
# Python, the packages of pyproject's `front` extra, and the front's own code.
#   docker build -f deploy/docker/front.Dockerfile -t REGISTRY/orpheus-megapod/front:0.1.0 .
# One stage, as llm-server-cpu.Dockerfile says why: the virtualenv is installed where it runs.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 megapod \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megapod
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Where pip looks: PyPI. A builder with no route to it sets a mirror (deploy/images/build_and_run.py
# serves one on loopback; deploy/README.md). A build argument only: no ENV carries it into the image.
ARG PIP_INDEX_URL=https://pypi.org/simple
WORKDIR /src
COPY pyproject.toml ./
# The `front` extra, read from pyproject.toml (its one list of the front's packages), in a layer of
# its own: a change to the sources rebuilds only the copies below.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['front']))" > /tmp/front.txt \
 && pip install -r /tmp/front.txt \
 && rm /tmp/front.txt
# The front's code and the shared modules it imports, beside the packages: not the project's wheel,
# whose dependencies (torch, the codec, the engine's) the front never loads.
COPY orpheus_common /opt/front/orpheus_common
COPY orpheus_front /opt/front/orpheus_front
WORKDIR /
ENV PYTHONPATH=/opt/front HOME=/tmp PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000
# Flags or MEGAPOD_FRONT_* variables configure it (python -m orpheus_front --help); the chart sets the variables.
ENTRYPOINT ["python", "-m", "orpheus_front"]
