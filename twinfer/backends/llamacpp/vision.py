"""The llama.cpp runner's `VisionTower`: a projector file (mmproj GGUF) read through libmtmd. Prompts are
expanded as the family's (`Architecture.image_text`) with mtmd's row count; images are resized as the
processor does (stretched), not letterboxed as llama-server does (docs/images.md)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from twinfer.backends.llamacpp._lib import _noop_log_callback
from twinfer.runtime.errors import BackendUnavailable, ModelError
from twinfer.runtime.loaders.gguf_reader import GGUFContents
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision import Image, ImageSpan
from twinfer.runtime.vision.gemma3 import merge_newlines

MAX_NEWLINES = 32  # newline runs shorter than this may be single tokens (Gemma's vocabulary has up to 31)
_IMAGE_CHUNK = 1  # MTMD_INPUT_CHUNK_TYPE_IMAGE


def projector_path(model: Path, mmproj: str, width: int) -> Path | None:
    """`mmproj`, None for "off", or for "auto" the one `mmproj*.gguf` beside `model` of its `width`."""
    if mmproj == "off":
        return None
    if mmproj != "auto":
        path = Path(mmproj).expanduser()
        if not path.is_file():
            raise ModelError(f"projector file not found: {path}; pass the mmproj GGUF that belongs to the model")
        return path
    siblings = [p for p in sorted(model.parent.glob("mmproj*.gguf")) if p != model]
    if len(siblings) != 1:
        return None
    try:
        meta = GGUFContents(siblings[0]).metadata
    except ModelError:
        return None
    return siblings[0] if meta.get("clip.vision.projection_dim") == width else None


def open_projector(lib: ModuleType, model: Any, path: Path, mmproj: str, spec: ModelSpec, n_threads: int,
                   verbose: bool) -> LlamaCppVision | None:
    """The tower for the runner's `model` (the GGUF at `path`), or None where `mmproj` finds no projector."""
    from twinfer.runtime.models import architecture

    found = projector_path(path, mmproj, int(lib.llama_model_n_embd(model)))
    if found is None:
        return None
    arch = architecture(spec.model_type)
    return LlamaCppVision(lib, model, found, arch.image_text if arch else None, n_threads=n_threads, verbose=verbose)


@contextmanager
def _chunks(mt: ModuleType) -> Iterator[Any]:
    chunks = mt.mtmd_input_chunks_init()
    try:
        yield chunks
    finally:
        mt.mtmd_input_chunks_free(chunks)


class LlamaCppVision:
    """A `VisionTower` over one mtmd context made for the runner's model, used from the engine's thread."""

    def __init__(self, lib: ModuleType, model: Any, path: Path, image_text: tuple[str, str] | None, *,
                 n_threads: int, verbose: bool = False):
        mt = _load_mtmd()
        contents = GGUFContents(path)
        meta = contents.metadata
        if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
            raise ModelError(f"{path} is not a projector with a vision encoder (an mmproj GGUF); pass the model's "
                             "mmproj file")
        if image_text is None:
            raise ModelError(f"{path}: twinfer does not know how this model's prompts place images; it reads "
                             "images through llama.cpp for the families in docs/images.md")
        if not verbose:
            quiet = _noop_log_callback(lib)
            mt.mtmd_log_set(quiet, ctypes.c_void_p(0))
            mt.mtmd_helper_log_set(quiet, ctypes.c_void_p(0))
        params = mt.mtmd_context_params_default()
        params.use_gpu = bool(lib.llama_supports_gpu_offload())
        params.n_threads = n_threads
        params.print_timings = False
        ctx = mt.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise ModelError(f"llama.cpp could not open the projector {path}: it is not an mmproj file, or it was "
                             f"made for another model (its width must be the model's {lib.llama_model_n_embd(model)})")
        self._mt, self._lib, self._ctx = mt, lib, ctx
        self.path = path
        self.image_size = int(meta.get("clip.vision.image_size", 0))
        self.n_embd = int(lib.llama_model_n_embd(model))
        self.bidirectional = bool(mt.mtmd_decode_use_non_causal(ctx, None))
        self._bytes = sum(t.nbytes for t in contents.tensors.values())
        self._vocab = lib.llama_model_get_vocab(model)
        self.wrap = self._tokenize(image_text[0])
        self.newlines = {ids[0]: n for n in range(1, MAX_NEWLINES) if len(ids := self._tokenize("\n" * n)) == 1}
        probe = Image(np.zeros((max(self.image_size, 1),) * 2 + (3,), np.uint8))
        self.begin, _, self.end = self._layout(probe)
        found = self._tokenize(image_text[1])
        self.placeholder = found[0] if len(found) == 1 else self.begin

    # -- VisionTower -------------------------------------------------------------------------------
    def expand(self, tokens: list[int], images: list[Image]) -> tuple[list[int], list[ImageSpan]]:
        """Each image-begin token (mtmd's, Gemma's `<start_of_image>`) becomes the family's run."""
        markers = [i for i, t in enumerate(tokens) if t == self.begin]
        if len(markers) != len(images):
            raise ValueError(f"the prompt has {len(markers)} image markers for {len(images)} images; give one image "
                             "per marker")
        rows = [self._layout(image)[1] for image in images]
        out: list[int] = []
        inserted: list[bool] = []
        prev = 0
        for at, n in zip([*markers, len(tokens)], [*rows, -1], strict=True):
            out += tokens[prev:at]
            inserted += [False] * (at - prev)
            if n >= 0:
                block = [*self.wrap, self.begin, *[self.placeholder] * n, *self.end, *self.wrap]
                out += block
                inserted += [True] * len(block)
            prev = at + 1
        out = merge_newlines(out, inserted, self.newlines, lambda n: self._tokenize("\n" * n))
        starts = [i + 1 for i, t in enumerate(out) if t == self.begin]
        return out, [ImageSpan(s, n, im) for s, n, im in zip(starts, rows, images, strict=True)]

    def encode(self, image: Image) -> np.ndarray:
        """float32 [rows, n_embd]: mtmd's encoding of the image, copied out of its context."""
        self._check_open()
        mt = self._mt
        with self._tokenized(image) as chunks:
            chunk = self._image_chunk(chunks)
            rows = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
            if int(mt.mtmd_encode_chunk(self._ctx, chunk)) != 0:
                raise ModelError(f"llama.cpp could not encode a {image.size[0]}x{image.size[1]} image with {self.path}")
            out = mt.mtmd_get_output_embd(self._ctx)
            return np.ctypeslib.as_array(out, shape=(rows, self.n_embd)).copy()

    def weight_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """Free the mtmd context (before its model). Safe to call twice."""
        if self._ctx:
            self._mt.mtmd_free(self._ctx)
            self._ctx = None

    # -- internals ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._ctx:
            raise RuntimeError("this llama.cpp vision tower is closed")

    def _tokenize(self, text: str) -> list[int]:
        """`text`'s ids, specials parsed, none added."""
        data = text.encode()
        buf = (ctypes.c_int32 * (len(data) + 8))()
        n = int(self._lib.llama_tokenize(self._vocab, data, len(data), buf, len(buf), False, True))
        if n < 0:
            raise ModelError(f"llama.cpp could not tokenize {text!r}")
        return list(buf[:n])

    def _pixels(self, image: Image) -> np.ndarray:
        from twinfer.runtime.vision.gemma3 import resize_bilinear

        side = self.image_size
        if side and image.pixels.shape[:2] != (side, side):
            return resize_bilinear(image.pixels, side)
        return np.ascontiguousarray(image.pixels)

    @contextmanager
    def _tokenized(self, image: Image) -> Iterator[Any]:
        """mtmd's chunks for the default media marker alone with `image` (text, image, text)."""
        self._check_open()
        mt = self._mt
        pixels = self._pixels(image)
        height, width = pixels.shape[:2]
        data = (ctypes.c_uint8 * pixels.size).from_buffer_copy(pixels.tobytes())
        bitmap = mt.mtmd_bitmap_init(width, height, data)
        if not bitmap:
            raise ModelError(f"llama.cpp could not take a {width}x{height} image")
        try:
            marker = mt.mtmd_default_marker()
            text = mt.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
            with _chunks(mt) as chunks:
                code = int(mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text),
                                            (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1))
                if code != 0:
                    raise ModelError(f"llama.cpp could not prepare a {width}x{height} image (mtmd_tokenize: {code})")
                yield chunks
        finally:
            mt.mtmd_bitmap_free(bitmap)

    def _image_chunk(self, chunks: Any) -> Any:
        mt = self._mt
        for i in range(int(mt.mtmd_input_chunks_size(chunks))):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            if int(mt.mtmd_input_chunk_get_type(chunk)) == _IMAGE_CHUNK:
                return chunk
        raise ModelError(f"{self.path}: mtmd made no image chunk for an image")

    def _layout(self, image: Image) -> tuple[int, int, list[int]]:
        """(image-begin token, feature rows, tokens after the rows) as mtmd lays out `image`."""
        mt = self._mt
        with self._tokenized(image) as chunks:
            parts: list[list[int] | int] = []
            for i in range(int(mt.mtmd_input_chunks_size(chunks))):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                if int(mt.mtmd_input_chunk_get_type(chunk)) == _IMAGE_CHUNK:
                    parts.append(int(mt.mtmd_input_chunk_get_n_tokens(chunk)))
                    continue
                n = ctypes.c_size_t()
                ids = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                parts.append([int(ids[j]) for j in range(n.value)])
        if len(parts) != 3 or not isinstance(parts[1], int) or not isinstance(parts[0], list) or not parts[0] \
                or not isinstance(parts[2], list):
            raise ModelError(f"{self.path}: mtmd lays an image out without an image-begin token; twinfer cannot "
                             "place its marker")
        return parts[0][-1], parts[1], parts[2]


def _load_mtmd() -> ModuleType:
    try:
        from llama_cpp import mtmd_cpp
    except (ImportError, OSError, RuntimeError) as exc:  # an older llama-cpp-python, or libmtmd missing
        raise BackendUnavailable(
            f"llama.cpp's multimodal library is unavailable ({exc}); images on GGUF models need a "
            "llama-cpp-python that ships llama_cpp/mtmd_cpp.py and libmtmd"
        ) from exc
    return mtmd_cpp
