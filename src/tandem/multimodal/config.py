"""`ImageConfig`: where images may come from and how big they may be (frontend flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.config_check import check_range

MIB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageConfig:
    """URL policy and limits for image parts of chat requests.

    `allowed_local_dir`: file:// URLs are served only from under this directory (None: refused).
    `allowed_hosts`: http(s) URLs only for these host names (empty: refused); an address in a
    private, loopback, link-local or reserved range is refused unless `allow_private_hosts`.
    `max_image_bytes` bounds one encoded image, `max_image_pixels` its width·height,
    `max_images_per_request` the image parts of one request; `fetch_timeout_s` one http(s) fetch.
    """

    max_image_bytes: int = 8 * MIB
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    allowed_local_dir: Path | None = None
    allowed_hosts: tuple[str, ...] = ()
    allow_private_hosts: bool = False
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_range("max_image_bytes", self.max_image_bytes, low=1)
        check_range("max_image_pixels", self.max_image_pixels, low=1)
        check_range("max_images_per_request", self.max_images_per_request, low=0)
        check_range("fetch_timeout_s", self.fetch_timeout_s, low=0, low_open=True)
        if self.allowed_local_dir is not None and not self.allowed_local_dir.is_dir():
            raise ValueError(
                f"allowed_local_dir={str(self.allowed_local_dir)!r} is not a directory; "
                "expected an existing directory"
            )
        for host in self.allowed_hosts:
            if not host or host != host.strip().lower() or "/" in host:
                raise ValueError(
                    f"allowed_hosts entry {host!r} is invalid; expected a lower-case host name "
                    "such as images.example.com"
                )
