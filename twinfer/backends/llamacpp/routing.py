"""Which experts a llama.cpp MoE routes each token to (`ffn_moe_topk`, via the eval callback), and the
expert pager's hit rate on the same steps: how much a skewed router flatters an expert cache."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twinfer.backends.llamacpp import paging
from twinfer.backends.llamacpp._lib import load_llama_cpp


class _Tensor(ctypes.Structure):
    """The head of ggml.h's `struct ggml_tensor` (GGML_MAX_DIMS 4, 64 B of op params, GGML_MAX_SRC 10)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def _rows(t: _Tensor, dtype: type[np.generic]) -> np.ndarray:
    """A 2-D tensor's [ne1, ne0] values (float32 or int32), copied row by row (strided views)."""
    n0, n1 = int(t.ne[0]), int(t.ne[1])
    row = (ctypes.c_float if dtype is np.float32 else ctypes.c_int32) * n0
    return np.stack([np.ctypeslib.as_array(row.from_address(t.data + j * t.nb[1])) for j in range(n1)])


def _topk(t_ptr: int) -> tuple[int, list[int]]:
    """An `ffn_moe_topk-L` tensor's layer L and the distinct experts its rows chose, ascending."""
    t = _Tensor.from_address(t_ptr)
    return int(t.name.rsplit(b"-", 1)[1]), np.unique(_rows(t, np.int32)).tolist()


@dataclass
class Prefetch:
    """A paged runner's eval callback: at each layer's `ffn_moe_topk` (the router's choice, computed before
    the expert matmuls read anything) the pager makes room for the chosen experts and starts reading them."""

    pager: paging.ExpertPager

    def callback(self, t_ptr: int, ask: bool, _: int) -> bool:
        if ask:
            return _Tensor.from_address(t_ptr).name.startswith(b"ffn_moe_topk-")
        layer, chosen = _topk(t_ptr)
        self.pager.make_room(layer, len(chosen))
        self.pager.fetch(layer, chosen)
        return True


@dataclass
class RouteTrace:
    """Per step and layer the distinct experts chosen (told to `pager.need` before they run); with `capture`,
    each layer's router input rows."""

    pager: paging.ExpertPager | None = None
    capture: bool = False
    steps: list[dict[int, list[int]]] = field(default_factory=list)
    inputs: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def callback(self, t_ptr: int, ask: bool, _: int) -> bool:
        t = _Tensor.from_address(t_ptr)
        name = t.name.decode(errors="replace")
        wanted = name.startswith("ffn_moe_topk-") or (self.capture and name.startswith("ffn_moe_logits-"))
        if ask or not wanted:
            return wanted if ask else True  # False after the ask stops the graph
        if name.startswith("ffn_moe_logits-"):  # mul_mat(router, x): x is src[1], [tokens, hidden]
            layer = int(name.rsplit("-", 1)[1])
            self.inputs.setdefault(layer, []).append(_rows(_Tensor.from_address(t.src[1]), np.float32))
            return True
        layer, chosen = _topk(t_ptr)
        self.steps[-1][layer] = chosen
        if self.pager is not None:
            self.pager.need(layer, chosen)
        return True


@dataclass(frozen=True)
class Routing:
    """Expert usage over a text's decode steps: `counts` [layers, experts]."""
    counts: np.ndarray
    pager: dict[str, int] | None

    @property
    def entropy(self) -> np.ndarray:
        """Each layer's usage entropy in nats (log(experts) when every expert is chosen equally often)."""
        p = self.counts / self.counts.sum(axis=1, keepdims=True)
        return -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(axis=1)

    def summary(self) -> dict[str, float | list[float] | dict[str, int] | None]:
        e = self.counts.shape[1]
        hits = self.pager["hits"] / max(1, self.pager["hits"] + self.pager["misses"]) if self.pager else None
        return {"experts": e, "log_experts": math.log(e), "entropy": [round(float(x), 4) for x in self.entropy],
                "entropy_ratio_min": round(float(self.entropy.min()) / math.log(e), 4),
                "top_share_max": round(float((self.counts.max(axis=1) / self.counts.sum(axis=1)).max()), 4),
                "hit_rate": hits, "pager": self.pager}


def trace(path: Path, prompt: list[int], decode: list[int], *, bound: int | None = None, threads: int = 1,
          capture: bool = False) -> tuple[RouteTrace, Routing]:
    """`prompt` in one step, then `decode` a token a step (teacher-forced, batch 1), experts paged under
    `bound` if given; usage counts the decode steps."""
    lib = load_llama_cpp()
    mparams = lib.llama_model_default_params()
    if hasattr(mparams, "use_extra_bufts"):
        mparams.use_extra_bufts = False  # repacked weights would leave the mapping
    before = paging.read_maps() if bound is not None else ""
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ValueError(f"llama.cpp could not load {path}")
    rt = RouteTrace(capture=capture)
    rt.pager = paging.ExpertPager.attach(path, before, bound) if bound is not None else None
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = -(-(len(prompt) + len(decode)) // 256) * 256
    cparams.n_threads = cparams.n_threads_batch = threads
    hook = lib.ggml_backend_sched_eval_callback(rt.callback)  # referenced until the context is freed
    cparams.cb_eval, cparams.cb_eval_user_data = hook, None
    ctx = lib.llama_init_from_model(model, cparams)
    pos = 0
    try:
        for i, tokens in enumerate([prompt, *([t] for t in decode)]):
            if i == 1 and rt.pager is not None:
                rt.pager.stats.hits = rt.pager.stats.misses = 0  # the prompt maps every expert: count decode
            rt.steps.append({})
            batch = lib.llama_batch_init(len(tokens), 0, 1)
            for j, token in enumerate(tokens):  # every row an output: the last layer then routes them all
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, pos + j, 1, True
                batch.seq_id[j][0] = 0
            batch.n_tokens, pos = len(tokens), pos + len(tokens)
            code = lib.llama_decode(ctx, batch)
            lib.llama_batch_free(batch)
            if code != 0:
                raise RuntimeError(f"llama_decode failed at step {i}")
            if rt.pager is not None:
                rt.pager.after_step()
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    n_layers, n_experts = max(max(s) for s in rt.steps) + 1, _experts(path)
    counts = np.zeros((n_layers, n_experts), np.int64)
    for step in rt.steps[1:]:
        for layer, chosen in step.items():
            counts[layer, chosen] += 1
    return rt, Routing(counts, rt.pager.describe() if rt.pager else None)


def vocabulary_text(path: Path, n: int, seed: int) -> list[int]:
    """`n` tokens: the model's normal tokens in shuffled rounds (a text favouring no token, unlike prose)."""
    from twinfer.runtime.loaders.gguf_reader import GGUFContents

    normal = np.flatnonzero(np.asarray(GGUFContents(path).array("tokenizer.ggml.token_type")) == 1)
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(normal) for _ in range(-(-n // len(normal)))])[:n].tolist()


def _experts(path: Path) -> int:
    from twinfer.runtime.loaders.gguf_reader import GGUFContents

    meta = GGUFContents(path).metadata
    return int(next(v for k, v in meta.items() if k.endswith(".expert_count")))
