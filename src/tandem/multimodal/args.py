"""`--mm-*` frontend flags → ImageConfig. `TANDEM_MM_*` env vars as fallbacks."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tandem.multimodal.config import ImageConfig


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TANDEM_{name}") or default


def add_image_args(parser: argparse.ArgumentParser) -> None:
    d = ImageConfig()
    g = parser.add_argument_group("images (chat image_url parts)")
    g.add_argument(
        "--mm-allowed-local-dir",
        default=_env("MM_ALLOWED_LOCAL_DIR", "") or None,
        metavar="DIR",
        help="serve file:// image URLs from under DIR only (default: file:// refused; env "
        "TANDEM_MM_ALLOWED_LOCAL_DIR)",
    )
    g.add_argument(
        "--mm-allowed-hosts",
        default=_env("MM_ALLOWED_HOSTS", ""),
        metavar="HOST,...",
        help="fetch http(s) image URLs from these hosts only (default: none; private and "
        "loopback addresses are refused; env TANDEM_MM_ALLOWED_HOSTS)",
    )
    g.add_argument(
        "--mm-allow-private-hosts",
        action="store_true",
        default=_env("MM_ALLOW_PRIVATE_HOSTS", "0").lower() in ("1", "true", "yes", "on"),
        help="let allow-listed hosts resolve to private/loopback addresses (an image store "
        "inside your network; env TANDEM_MM_ALLOW_PRIVATE_HOSTS)",
    )
    for flag, default, help_ in (
        ("--mm-max-image-bytes", d.max_image_bytes, "largest encoded image"),
        ("--mm-max-image-pixels", d.max_image_pixels, "largest image width x height"),
        ("--mm-max-images-per-request", d.max_images_per_request, "most image parts per request"),
    ):
        env = flag.lstrip("-").replace("-", "_").upper()
        g.add_argument(
            flag, type=int, default=int(_env(env, str(default))), help=f"{help_} (env TANDEM_{env})"
        )
    g.add_argument(
        "--mm-fetch-timeout-s",
        type=float,
        default=float(_env("MM_FETCH_TIMEOUT_S", str(d.fetch_timeout_s))),
        help="timeout of one http(s) image fetch (env TANDEM_MM_FETCH_TIMEOUT_S)",
    )


def image_config_from_args(ns: argparse.Namespace) -> ImageConfig:
    hosts = tuple(h.strip().lower() for h in ns.mm_allowed_hosts.split(",") if h.strip())
    return ImageConfig(
        max_image_bytes=ns.mm_max_image_bytes,
        max_image_pixels=ns.mm_max_image_pixels,
        max_images_per_request=ns.mm_max_images_per_request,
        allowed_local_dir=Path(ns.mm_allowed_local_dir) if ns.mm_allowed_local_dir else None,
        allowed_hosts=hosts,
        allow_private_hosts=ns.mm_allow_private_hosts,
        fetch_timeout_s=ns.mm_fetch_timeout_s,
    )
