"""Image URL policy and limits (tandem.multimodal.loader): each refusal is a 400 naming the part."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from tests.support.images import data_url, photo_bytes, synthetic_png

from tandem.errors import InvalidRequest
from tandem.multimodal.config import ImageConfig
from tandem.multimodal.image import decode_image
from tandem.multimodal.loader import ImageLoader, is_public_address

P = "messages[0].content[1]"


async def _load(url: str, **config: object) -> object:
    loader = ImageLoader(ImageConfig(**config))  # type: ignore[arg-type]
    try:
        return await loader.load(url, param=P)
    finally:
        await loader.close()


async def _refused(url: str, match: str, **config: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest, match=match) as info:
        await _load(url, **config)
    assert info.value.param == P and P in info.value.message
    return info.value


async def test_data_url_png_and_jpeg_decode_to_rgb_with_pixel_hash() -> None:
    png = synthetic_png(8, 6, seed=1)
    img = await _load(data_url(png))
    assert img.pixels.shape == (6, 8, 3) and img.source_bytes == png  # type: ignore[attr-defined]
    jpeg = photo_bytes("rocket.jpg")
    assert (await _load(data_url(jpeg, "image/jpeg"))).pixels.ndim == 3  # type: ignore[attr-defined]


def test_mm_hash_is_of_pixels_not_encoding() -> None:
    import io

    from PIL import Image

    png = synthetic_png(8, 6, seed=2)
    again = io.BytesIO()
    Image.open(io.BytesIO(png)).save(again, "PNG", compress_level=0)  # other bytes, same pixels
    assert again.getvalue() != png
    assert decode_image(png).mm_hash == decode_image(again.getvalue()).mm_hash
    assert decode_image(png).mm_hash != decode_image(synthetic_png(8, 6, seed=3)).mm_hash
    # same bytes, other shape → other hash
    assert decode_image(synthetic_png(6, 8, seed=2)).mm_hash != decode_image(png).mm_hash


async def test_bad_base64_is_refused() -> None:
    await _refused("data:image/png;base64,iVBOR!!w0KGgo=", "not valid base64")


async def test_wrong_mime_is_refused() -> None:
    gif = photo_bytes("no_time_for_that_tiny.gif")
    await _refused(data_url(gif, "image/gif"), "MIME type 'image/gif' is not supported")
    await _refused(data_url(synthetic_png(), "text/plain"), "'text/plain' is not supported")
    # declared PNG, bytes are a GIF / a JPEG
    await _refused(data_url(gif), "unsupported image format 'GIF'")
    await _refused(data_url(photo_bytes("rocket.jpg")), "declared image/png but the bytes are JPEG")


async def test_not_base64_data_url_and_undecodable_bytes_are_refused() -> None:
    await _refused("data:image/png,rawbytes", "is not base64")
    await _refused(data_url(b"\x89PNG\r\n\x1a\n garbage"), "cannot decode the image")


async def test_oversize_bytes_and_pixels_are_refused() -> None:
    png = photo_bytes("coffee.png")  # 400x600
    await _refused(
        data_url(png), rf"over the limit of {len(png) - 1} bytes", max_image_bytes=len(png) - 1
    )
    await _refused(
        data_url(png), "400 = 240000 pixels, over the limit of 100000", max_image_pixels=100_000
    )


async def test_unknown_scheme_is_refused() -> None:
    await _refused("ftp://x/y.png", "scheme 'ftp' is not supported")


async def test_file_urls_only_under_the_allowed_dir(tmp_path: Path) -> None:
    inside = tmp_path / "ok"
    inside.mkdir()
    (inside / "a.png").write_bytes(synthetic_png(seed=4))
    (tmp_path / "secret.png").write_bytes(synthetic_png(seed=5))
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    img = await _load(f"file://{inside / 'a.png'}", allowed_local_dir=inside)
    assert img.pixels.shape == (6, 8, 3)  # type: ignore[attr-defined]
    await _refused(f"file://{inside / 'a.png'}", "refused; the server allows local files only")
    await _refused(
        f"file://{tmp_path / 'secret.png'}",
        "outside the allowed directory",
        allowed_local_dir=inside,
    )
    await _refused(
        f"file://{inside}/../secret.png", "outside the allowed directory", allowed_local_dir=inside
    )
    await _refused(
        f"file://{inside / 'link.png'}", "outside the allowed directory", allowed_local_dir=inside
    )
    await _refused(f"file://{inside / 'nope.png'}", "cannot read", allowed_local_dir=inside)


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    png = synthetic_png(seed=6)

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=png, content_type="image/png")

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # no Content-Length: the cap must hold while reading
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b"\0" * 4096)
        return resp

    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()  # until the test is over: the client must give up first
        return web.Response(body=png)

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/image.png")

    app = web.Application()
    app.router.add_get("/image.png", image)
    app.router.add_get("/big.png", big)
    app.router.add_get("/slow.png", slow)
    app.router.add_get("/moved.png", moved)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"127.0.0.1:{port}"
    release.set()
    await runner.cleanup()


async def test_http_host_must_be_allow_listed(image_server: str) -> None:
    await _refused(
        f"http://{image_server}/image.png", r"host '127.0.0.1' is not allowed \(allowed: none"
    )


async def test_http_private_addresses_refused_even_when_listed(image_server: str) -> None:
    port = image_server.split(":")[1]
    await _refused(
        f"http://{image_server}/image.png", "private/loopback", allowed_hosts=("127.0.0.1",)
    )
    # a name that resolves to loopback is refused by the resolver the connection uses
    await _refused(
        f"http://localhost:{port}/image.png",
        "resolves to .*127.0.0.1",
        allowed_hosts=("localhost",),
    )


async def test_http_fetch_with_private_hosts_allowed(image_server: str) -> None:
    cfg = {"allowed_hosts": ("127.0.0.1",), "allow_private_hosts": True}
    img = await _load(f"http://{image_server}/image.png", **cfg)
    assert img.pixels.shape == (6, 8, 3)  # type: ignore[attr-defined]
    await _refused(
        f"http://{image_server}/big.png", "over the limit of 100000", max_image_bytes=100_000, **cfg
    )
    await _refused(f"http://{image_server}/moved.png", "HTTP 302; expected 200", **cfg)
    await _refused(
        f"http://{image_server}/slow.png", "no answer within 0.3s", fetch_timeout_s=0.3, **cfg
    )


def test_public_address_ranges() -> None:
    assert is_public_address("8.8.8.8") and is_public_address("2606:4700::1111")
    for addr in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1", "fc00::1",
                 "::ffff:127.0.0.1", "0.0.0.0", "224.0.0.1", "100.64.0.1"):  # fmt: skip
        assert not is_public_address(addr), addr
