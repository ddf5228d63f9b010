"""vLLM in-process as a tandem engine (`--engine vllm`); needs the `.venv-vllm` virtualenv."""
