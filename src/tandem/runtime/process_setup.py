"""What every `tandem` process entry point does before its service runs: configure logging
(only entry points do; STYLE.md) and tracing, and run the service coroutine on uvloop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from tandem.runtime.log_format import LOG_FORMATS, make_formatter

T = TypeVar("T")
# an ArgumentParser or one of its argument groups (argparse's common base of the two)
ArgumentContainer = argparse._ActionsContainer


def add_log_format_arg(parser: ArgumentContainer) -> None:
    """`--log-format text|json` on a parser or argument group."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object per line (ts, level, logger, message, request_id "
        "on request-scoped lines)",
    )


def add_tracing_args(parser: ArgumentContainer, service_name: str) -> None:
    """`--otlp-endpoint` and `--otlp-service-name` (OpenTelemetry traces; off by default)."""
    parser.add_argument(
        "--otlp-endpoint",
        # OpenTelemetry's own variable as the default; TANDEM_OTLP_ENDPOINT (flag_parser.py)
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "",
        help="export OpenTelemetry spans of every request by OTLP http/protobuf to this base "
        "URL (e.g. http://127.0.0.1:4318; /v1/traces is appended); empty: tracing off, at no "
        "cost (also OTEL_EXPORTER_OTLP_ENDPOINT, below TANDEM_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--otlp-service-name",
        default=os.environ.get("OTEL_SERVICE_NAME") or service_name,
        help=f"service.name of this process's spans (env OTEL_SERVICE_NAME; default "
        f"{service_name})",
    )


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter(log_format))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def configure_tracing(args: argparse.Namespace) -> None:
    """Turn tracing on when `--otlp-endpoint` is set; otherwise nothing is imported."""
    endpoint = getattr(args, "otlp_endpoint", "")
    if endpoint:
        from tandem.runtime import tracing

        tracing.configure(endpoint, args.otlp_service_name)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` to completion on uvloop (plain asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)
