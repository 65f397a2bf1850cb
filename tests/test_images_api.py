"""Images through the HTTP APIs: the real `openai` (chat, Responses) and `anthropic` clients, streamed and
not, against the server on the tiny Gemma 3 vision checkpoint (torch runner), each answer equal to the
same prompt and image run straight through the engine; and every bad image a 4xx naming its part, the
server healthy after them."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import io
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from vision_models import random_pixels, save_tiny_gemma3_vision  # noqa: E402

from twinfer.backends.cuda.runner import load_torch_runner  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402
from twinfer.runtime.tokenizer import load_tokenizer  # noqa: E402
from twinfer.runtime.vision import Image  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.images import ImageLimits  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

MODEL = "tiny-gemma3-vision"
QUESTION = "What is it?"
MAX_TOKENS = 8
LIMITS = ImageLimits(max_images=2, max_bytes=64 * 1024, max_pixels=64 * 64, fetch_timeout_s=5.0)


def png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    PIL.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


PIXELS = {seed: random_pixels(seed, 40, 30) for seed in (1, 2)}
URLS = {seed: data_url(png(p)) for seed, p in PIXELS.items()}


@functools.cache
def folder() -> Path:
    return save_tiny_gemma3_vision(Path(tempfile.mkdtemp(prefix="twinfer-images-api-")) / "gemma3-vision")


def new_engine(vision: bool = True) -> Engine:
    runner = load_torch_runner(load_model(folder()), kv_tokens=64 * 16, block_size=16)
    if not vision:
        runner.vision = None
    return Engine(runner, load_tokenizer(folder()), EngineConfig(max_seqs=4))


@contextlib.contextmanager
def serving(engine: Engine, limits: ImageLimits = LIMITS) -> Iterator[ServerThread]:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    app = create_app(async_engine, engine.tokenizer, MODEL, guard=GuardConfig(enabled=False), images=limits)
    st = ServerThread(app).start()
    try:
        yield st
    finally:
        with contextlib.suppress(Exception):
            st.call(async_engine.shutdown(drain=False))
        st.stop()


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerThread]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a spinning OpenMP pool stalls the server's loop on two cores
    try:
        with serving(new_engine()) as st:
            yield st
    finally:
        torch.set_num_threads(threads)


@functools.cache
def expected(seed: int) -> str:
    """The greedy answer straight through a fresh engine: the template with an image part, the image."""
    e = new_engine()
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]
    ids = e.tokenizer.encode_chat(messages)
    rid = e.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guard=GuardConfig(enabled=False)),
                        images=[Image(PIXELS[seed])])
    while e.has_work:
        e.step()
    return e.requests[rid].text


def chat(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def oa(st: ServerThread) -> Any:
    return openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=120)


KNOBS: dict[str, Any] = {"temperature": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_with_an_image(srv: ServerThread, stream: bool) -> None:
    client = oa(srv)
    texts = {}
    for seed, url in URLS.items():
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=chat(url), max_tokens=MAX_TOKENS,
                                                         stream=True, stream_options={"include_usage": True}, **KNOBS))
            texts[seed] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(model=MODEL, messages=chat(url), max_tokens=MAX_TOKENS, **KNOBS)
            texts[seed], usage = r.choices[0].message.content, r.usage
        assert texts[seed] == expected(seed)
        assert usage.prompt_tokens_details.image_tokens == 16
    assert texts[1] != texts[2] and texts[1] and texts[2]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_with_an_image(srv: ServerThread, stream: bool) -> None:
    content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": URLS[1]}]
    items = [{"role": "user", "content": content}]
    client = oa(srv)
    if stream:
        events = list(client.responses.create(model=MODEL, input=items, max_output_tokens=MAX_TOKENS, stream=True,
                                              **KNOBS))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].response.output_text == text
    else:
        text = client.responses.create(model=MODEL, input=items, max_output_tokens=MAX_TOKENS, **KNOBS).output_text
    assert text == expected(1)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_with_an_image(srv: ServerThread, stream: bool) -> None:
    source = {"type": "base64", "media_type": "image/png", "data": URLS[1].split(",", 1)[1]}
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image", "source": source}]}]
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": messages,
                          "extra_body": {"temperature": 0}}
    if stream:
        with client.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
    else:
        text = client.messages.create(**kw).content[0].text
    assert text == expected(1)
    count = client.messages.count_tokens(model=MODEL, messages=messages)
    e = new_engine()
    ids = e.tokenizer.encode_chat([{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}])
    assert e.runner.vision is not None
    assert count.input_tokens == len(e.runner.vision.expand(ids, [Image(PIXELS[1])])[0]) >= len(ids) + 16


def post(st: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(st.url + path, json=body, timeout=60)


def chat_body(*parts: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": role, "content": [
        {"type": "text", "text": QUESTION}, *parts]}]}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


BIG = random_pixels(3, 80, 80)  # 6,400 pixels: over LIMITS.max_pixels
BAD_CHAT = {
    "not an image": (image(data_url(b"hello, I am text")), 400, "not an image"),
    "bad base64": (image("data:image/png;base64,@@@@"), 400, "not valid base64"),
    "not base64": (image("data:image/png,rawbytes"), 400, "must be base64"),
    "too many pixels": (image(data_url(png(BIG))), 413, "80x80 pixels"),
    "too many bytes": (image(data_url(b"\0" * 70_000)), 413, "the limit is 65,536"),
    "text media type": (image(data_url(b"hello", "text/plain")), 415, "text/plain is not an image type"),
    "tiff": (image(data_url(png(PIXELS[1], "TIFF"), "image/tiff")), 415, "TIFF images are not accepted"),
    "remote url": (image("https://example.com/cat.png"), 400, "does not fetch image URLs"),
    "no url": ({"type": "image_url", "image_url": {}}, 400, "needs image_url.url"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_images_are_4xx_naming_the_part(srv: ServerThread, case: str) -> None:
    part, status, words = BAD_CHAT[case]
    r = post(srv, "/v1/chat/completions", chat_body(part))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"].startswith("messages[0].content[1]: ") and words in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_more_refusals_name_their_part(srv: ServerThread) -> None:
    r = post(srv, "/v1/chat/completions", chat_body(image(URLS[1]), image(URLS[2]), image(URLS[1])))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[3]"
    assert "at most 2 images, this one has 3" in r.json()["error"]["message"]
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": [image(URLS[1])]}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "images go in user messages" in r.json()["error"]["message"]
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
    r = post(srv, "/v1/messages", {"model": MODEL, "max_tokens": 2, "system": "be brief",
                                   "messages": [{"role": "user", "content": [bad]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                          {"type": "input_image", "image_url": data_url(b"nope")}]}]
    r = post(srv, "/v1/responses", {"model": MODEL, "input": items, "instructions": "be brief"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[1]"
    ok = oa(srv).chat.completions.create(model=MODEL, messages=chat(URLS[1]), max_tokens=MAX_TOKENS, **KNOBS)
    assert ok.choices[0].message.content == expected(1)  # still serving


def test_a_text_model_reads_no_images() -> None:
    with serving(new_engine(vision=False)) as st:
        r = post(st, "/v1/chat/completions", chat_body(image(URLS[1])))
        assert r.status_code == 400 and r.json()["error"]["code"] == "images_unsupported"
        assert r.json()["error"]["message"].startswith("messages[0].content[1]: this model reads no images")
        assert post(st, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": QUESTION}]}).status_code == 200


@contextlib.contextmanager
def file_server(files: dict[str, bytes]) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_fetched_image_urls_within_bounds() -> None:
    limits = ImageLimits(max_images=2, max_bytes=64 * 1024, max_pixels=64 * 64, fetch_urls=True, fetch_timeout_s=5)
    with file_server({"/cat.png": png(PIXELS[1]), "/huge.bin": b"\0" * 70_000}) as files, \
            serving(new_engine(), limits) as st:
        r = oa(st).chat.completions.create(model=MODEL, messages=chat(files + "/cat.png"), max_tokens=MAX_TOKENS,
                                           **KNOBS)
        assert r.choices[0].message.content == expected(1)
        huge = post(st, "/v1/chat/completions", chat_body(image(files + "/huge.bin")))
        assert huge.status_code == 413 and huge.json()["error"]["param"] == "messages[0].content[1]"
        gone = post(st, "/v1/chat/completions", chat_body(image(files + "/missing.png")))
        assert gone.status_code == 400 and "answered HTTP 404" in gone.json()["error"]["message"]
