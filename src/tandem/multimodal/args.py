"""`--mm-*` frontend flags → ImageConfig (env and config-file values:
`tandem.runtime.flag_parser`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.multimodal.config import ImageConfig


def add_image_args(parser: argparse.ArgumentParser) -> None:
    d = ImageConfig()
    g = parser.add_argument_group("images (chat image_url parts)")
    g.add_argument(
        "--mm-allowed-local-dir",
        default=None,
        metavar="DIR",
        help="serve file:// image URLs from under DIR only (default: file:// refused)",
    )
    g.add_argument(
        "--mm-allowed-hosts",
        default="",
        metavar="HOST,...",
        help="fetch http(s) image URLs from these hosts only (default: none; private and "
        "loopback addresses are refused)",
    )
    g.add_argument(
        "--mm-allow-private-hosts",
        action="store_true",
        help="let allow-listed hosts resolve to private/loopback addresses (an image store "
        "inside your network)",
    )
    for flag, default, help_ in (
        ("--mm-max-image-bytes", d.max_image_bytes, "largest encoded image"),
        ("--mm-max-image-pixels", d.max_image_pixels, "largest image width x height"),
        ("--mm-max-images-per-request", d.max_images_per_request, "most image parts per request"),
    ):
        g.add_argument(flag, type=int, default=default, help=help_)
    g.add_argument(
        "--mm-fetch-timeout-s",
        type=float,
        default=d.fetch_timeout_s,
        help="timeout of one http(s) image fetch",
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
