"""Images in requests: every API's image part becomes OpenAI's `image_url` part, each is read (a base64
data URL, or a remote http(s) URL when the server fetches them), decoded with Pillow within the limits,
and replaced in the message by `{"type": "image"}`, the part chat templates render as the model's image
marker. Every refusal is a 4xx naming the part (docs/images.md)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from twinfer.runtime.errors import MissingPackage, require
from twinfer.runtime.vision import Image
from twinfer.server.errors import APIError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may decode here; others are refused
WHERE = "_where"  # an image part's place in the request as the client wrote it (set by the API's converter)


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts: `max_images` per request, `max_bytes` per encoded image, `max_pixels` per
    decoded one; remote URLs only with `fetch_urls`, each fetched within `fetch_timeout_s`."""

    max_images: int = 8
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    fetch_urls: bool = False
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if min(self.max_images, self.max_bytes, self.max_pixels) < 1 or self.fetch_timeout_s <= 0:
            raise ValueError("image limits must be positive")


def image_part(url: Any, where: str) -> dict[str, Any]:
    """An image part in OpenAI's chat form, remembering where the client put it."""
    return {"type": "image_url", "image_url": {"url": url}, WHERE: where}


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(message index, part index, where) of every image part, in prompt order."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_url", "input_image", "image"):
                found.append((i, j, str(part.get(WHERE, f"messages[{i}].content[{j}]"))))
    return found


async def take_images(messages: list[dict[str, Any]], limits: ImageLimits, reads_images: bool
                      ) -> tuple[list[dict[str, Any]], list[Image]]:
    """The messages with each image part replaced by {"type": "image"}, and the decoded images in order."""
    found = image_parts(messages)
    if not found:
        return messages, []
    first = found[0][2]
    if not reads_images:
        raise APIError(400, f"{first}: this model reads no images; send text only, or serve a model with a "
                       "vision tower", param=first, code="images_unsupported")
    if len(found) > limits.max_images:
        where = found[limits.max_images][2]
        raise APIError(400, f"{where}: a request may carry at most {limits.max_images} images, this one has "
                       f"{len(found)}", param=where, code="too_many_images")
    out = [dict(m) for m in messages]
    images = []
    for i, j, where in found:
        role = out[i].get("role")
        if role != "user":
            raise APIError(400, f"{where}: images go in user messages, not {role!r} ones", param=where,
                           code="invalid_image")
        content = out[i]["content"] = list(out[i]["content"])
        data = await _read(content[j], where, limits)
        images.append(await asyncio.to_thread(decode_image, data, where, limits))
        content[j] = {"type": "image"}
    return out, images


async def _read(part: dict[str, Any], where: str, limits: ImageLimits) -> bytes:
    """The encoded image bytes a part points at."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: an image part needs image_url.url (a data: URL, or http(s) where the "
                       "server fetches them)", param=where, code="invalid_image")
    if url.startswith("data:"):
        return _data_url(url, where, limits)
    if url.startswith(("http://", "https://")):
        if not limits.fetch_urls:
            raise APIError(400, f"{where}: this server does not fetch image URLs; send the image inline as a "
                           "base64 data URL (data:image/png;base64,...), or start the server with "
                           "--fetch-image-urls", param=where, code="image_url_refused")
        return await _fetch(url, where, limits)
    raise APIError(400, f"{where}: the image URL must be a data: URL or http(s), got {url[:32]!r}", param=where,
                   code="invalid_image")


def _data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    head, sep, payload = url.partition(",")
    media = head[5:].split(";")[0].strip().lower()
    if not sep or not head.endswith(";base64"):
        raise APIError(400, f"{where}: the data URL must be base64 (data:image/png;base64,...)", param=where,
                       code="invalid_image")
    if media and not media.startswith("image/"):
        raise APIError(415, f"{where}: {media} is not an image type; send PNG, JPEG, WebP, GIF or BMP",
                       param=where, code="unsupported_image_type")
    if len(payload) * 3 // 4 > limits.max_bytes + 2:
        raise _too_big(where, len(payload) * 3 // 4, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}: the data URL's payload is not valid base64 ({e})", param=where,
                       code="invalid_image") from e


def _too_big(where: str, nbytes: int, limits: ImageLimits) -> APIError:
    return APIError(413, f"{where}: the image has {nbytes:,} bytes; the limit is {limits.max_bytes:,}",
                    param=where, code="image_too_large")


async def _fetch(url: str, where: str, limits: ImageLimits) -> bytes:
    """GET `url` within the time and size limits (the size checked as bytes arrive)."""
    import httpx

    data = bytearray()
    try:
        async with (httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=True) as client,
                    asyncio.timeout(limits.fetch_timeout_s), client.stream("GET", url) as reply):
            if reply.status_code != 200:
                raise APIError(400, f"{where}: fetching the image URL answered HTTP {reply.status_code}",
                               param=where, code="image_fetch_failed")
            async for piece in reply.aiter_bytes():
                data += piece
                if len(data) > limits.max_bytes:
                    raise _too_big(where, len(data), limits)
    except (httpx.HTTPError, TimeoutError) as e:
        raise APIError(400, f"{where}: the image URL could not be fetched within {limits.fetch_timeout_s:g} s "
                       f"({type(e).__name__})", param=where, code="image_fetch_failed") from e
    return bytes(data)


def decode_image(data: bytes, where: str, limits: ImageLimits) -> Image:
    """RGB pixels of an encoded image (the first frame of an animation); APIError when it cannot be used."""
    try:
        require("reading images", "PIL")
    except MissingPackage as e:
        raise APIError(500, str(e), "server_error", code="missing_package") from e
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise _too_big(where, len(data), limits)
    try:
        picture = PILImage.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise APIError(400, f"{where}: the data is not an image (PNG, JPEG, WebP, GIF or BMP)", param=where,
                       code="invalid_image") from e
    except PILImage.DecompressionBombError as e:
        raise APIError(413, f"{where}: {e}", param=where, code="image_too_large") from e
    if picture.format not in FORMATS:
        raise APIError(415, f"{where}: {picture.format} images are not accepted; send PNG, JPEG, WebP, GIF or BMP",
                       param=where, code="unsupported_image_type")
    width, height = picture.size
    if width * height > limits.max_pixels:
        raise APIError(413, f"{where}: the image is {width}x{height} pixels; the limit is {limits.max_pixels:,} "
                       "pixels", param=where, code="image_too_large")
    import numpy as np

    try:
        rgb = picture.convert("RGB")
    except (OSError, ValueError, PILImage.DecompressionBombError) as e:
        raise APIError(400, f"{where}: the image cannot be decoded ({e})", param=where, code="invalid_image") from e
    return Image(np.asarray(rgb, dtype=np.uint8).copy())
