"""Image URLs → decoded images under the frontend's policy (DESIGN.md §10).

Accepted: `data:image/png;base64,...` and `data:image/jpeg;base64,...`; `file://` paths under
`--mm-allowed-local-dir`; `http(s)://` URLs whose host is on `--mm-allowed-hosts` and resolves to
public addresses only (the check runs in the resolver the connection uses, so a DNS answer cannot
change between check and connect). Every refusal is an `InvalidRequest` naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from tandem.errors import InvalidRequest
from tandem.multimodal.config import ImageConfig
from tandem.multimodal.image import ACCEPTED_FORMATS, DecodedImage, decode_image

# images bigger than this (bytes) are decoded off the event loop: a 450x300 PNG (240 kB) takes
# ~10 ms to decode and hash, a stall of every stream the frontend is writing
_THREAD_DECODE_BYTES = 16 << 10


class PrivateAddressError(OSError):
    """The host resolved to an address the policy refuses."""


def is_public_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _PublicOnlyResolver(AbstractResolver):
    """Resolves like aiohttp's threaded resolver, then refuses non-public addresses."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        refused = [r["host"] for r in results if not is_public_address(r["host"])]
        if refused:
            raise PrivateAddressError(
                f"host {host!r} resolves to {', '.join(refused)}, a private/loopback/reserved "
                "address; refused (--mm-allow-private-hosts allows it)"
            )
        return results

    async def close(self) -> None:
        await self._inner.close()


class ImageLoader:
    """Loads image URLs under one `ImageConfig`. Safe for concurrent use on one event loop;
    `close()` releases the http session."""

    def __init__(self, config: ImageConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def load(self, url: str, *, param: str) -> DecodedImage:
        """The decoded image at `url`; `param` (e.g. "messages[0].content[1]") names the part in
        errors. Raises InvalidRequest for a refused URL, an oversize or undecodable image."""
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{param}.image_url.url must be a non-empty string", param=param)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data, mime = self._from_data_url(url, param), _data_mime(url)
        elif scheme == "file":
            data, mime = await asyncio.to_thread(self._from_file, url, param), None
        elif scheme in ("http", "https"):
            data, mime = await self._from_http(url, param), None
        else:
            raise InvalidRequest(
                f"{param}: image URL scheme {scheme or url[:16]!r} is not supported; expected "
                "data:image/png|jpeg;base64,..., file:// (under --mm-allowed-local-dir) or "
                "http(s):// (hosts on --mm-allowed-hosts)",
                param=param,
            )
        return await self._decode(data, param, mime)

    async def _decode(self, data: bytes, param: str, mime: str | None) -> DecodedImage:
        limit = self.config.max_image_pixels
        decode = functools.partial(
            decode_image, data, max_pixels=limit, what=param, declared_mime=mime
        )
        return await asyncio.to_thread(decode) if len(data) > _THREAD_DECODE_BYTES else decode()

    def _too_big(self, num_bytes: int | str, param: str) -> InvalidRequest:
        return InvalidRequest(
            f"{param}: image is {num_bytes} bytes, over the limit of {self.config.max_image_bytes}"
            " bytes (--mm-max-image-bytes)",
            param=param,
        )

    # ---------------------------------------------------------------- data:
    def _from_data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url.partition(",")
        mime = _data_mime(url)
        if not sep or not header.lower().endswith(";base64"):
            raise InvalidRequest(
                f"{param}: data URL {header[:40]!r} is not base64; expected "
                "data:image/png;base64,... or data:image/jpeg;base64,...",
                param=param,
            )
        if mime not in ACCEPTED_FORMATS:
            raise InvalidRequest(
                f"{param}: data URL MIME type {mime!r} is not supported; expected one of: "
                f"{', '.join(ACCEPTED_FORMATS)}",
                param=param,
            )
        if len(payload) // 4 * 3 > self.config.max_image_bytes + 2:
            raise self._too_big(f"about {len(payload) // 4 * 3}", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(
                f"{param}: data URL payload is not valid base64 ({exc})", param=param
            ) from exc
        if len(data) > self.config.max_image_bytes:
            raise self._too_big(len(data), param)
        return data

    # ---------------------------------------------------------------- file://
    def _from_file(self, url: str, param: str) -> bytes:
        root = self.config.allowed_local_dir
        if root is None:
            raise InvalidRequest(
                f"{param}: file:// image URLs are refused; the server allows local files only "
                "with --mm-allowed-local-dir",
                param=param,
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequest(
                f"{param}: file URL host {parts.netloc!r} is not supported; expected file:///path",
                param=param,
            )
        path = Path(os.path.realpath(unquote(parts.path)))
        allowed = Path(os.path.realpath(root))
        if not path.is_relative_to(allowed):
            raise InvalidRequest(
                f"{param}: file {str(path)!r} is outside the allowed directory "
                f"{str(allowed)!r} (--mm-allowed-local-dir)",
                param=param,
            )
        try:
            size = path.stat().st_size
            if size > self.config.max_image_bytes:
                raise self._too_big(size, param)
            with path.open("rb") as f:
                return f.read(self.config.max_image_bytes + 1)
        except OSError as exc:
            raise InvalidRequest(f"{param}: cannot read {str(path)!r}: {exc}", param=param) from exc

    # ---------------------------------------------------------------- http(s)://
    async def _from_http(self, url: str, param: str) -> bytes:
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.config.allowed_hosts:
            allowed = ", ".join(self.config.allowed_hosts) or "none"
            raise InvalidRequest(
                f"{param}: image host {host!r} is not allowed (allowed: {allowed}; "
                "--mm-allowed-hosts)",
                param=param,
            )
        private_literal = _is_ip_literal(host) and not is_public_address(host)
        if private_literal and not self.config.allow_private_hosts:
            raise InvalidRequest(
                f"{param}: image host {host} is a private/loopback/reserved address; refused",
                param=param,
            )
        try:
            return await self._fetch(url, param)
        except aiohttp.ClientConnectorError as exc:
            cause: Any = exc.os_error
            reason = str(cause) if isinstance(cause, PrivateAddressError) else str(exc)
            raise InvalidRequest(f"{param}: cannot fetch {url!r}: {reason}", param=param) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = (
                f"no answer within {self.config.fetch_timeout_s}s"
                if isinstance(exc, TimeoutError)
                else str(exc) or type(exc).__name__
            )
            raise InvalidRequest(f"{param}: cannot fetch {url!r}: {why}", param=param) from exc

    async def _fetch(self, url: str, param: str) -> bytes:
        limit = self.config.max_image_bytes
        timeout = aiohttp.ClientTimeout(total=self.config.fetch_timeout_s)
        async with self._http().get(url, allow_redirects=False, timeout=timeout) as resp:
            if resp.status != 200:
                raise InvalidRequest(
                    f"{param}: fetching {url!r} answered HTTP {resp.status}; expected 200 "
                    "(redirects are not followed)",
                    param=param,
                )
            if resp.content_length is not None and resp.content_length > limit:
                raise self._too_big(resp.content_length, param)
            body = bytearray()
            async for chunk in resp.content.iter_chunked(64 << 10):
                body += chunk
                if len(body) > limit:
                    raise self._too_big(f"more than {len(body)}", param)
            return bytes(body)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            resolver = None if self.config.allow_private_hosts else _PublicOnlyResolver()
            connector = aiohttp.TCPConnector(resolver=resolver, limit=64)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _data_mime(url: str) -> str:
    header = url.partition(",")[0]
    return header[len("data:") :].split(";", 1)[0].strip().lower()


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
