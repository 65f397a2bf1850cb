"""A parallel rank reads only its part of each weight from the model file.

Loader level: a region read equals the full read cut to the region, for safetensors (F32, F16, BF16,
checked against safetensors' own `get_slice`), GGUF float and Q8_0 tensors, and the transforms a
canonical weight may go through (llama.cpp's rope permutation, per-expert stacking, HF's fused
gate_up). Rank level: a TP=2 rank of a tiny llama saved as safetensors reads exactly half the bytes
of every split tensor and never a whole one, a PP=2 stage reads nothing of the other stage, and an
expert-parallel rank reads only its experts' slices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinfer.runtime.loaders import load_model
from twinfer.runtime.loaders.gguf_file import GGUFTensor, read_gguf
from twinfer.runtime.loaders.gguf_reader import ggml_type_name
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor, read_safetensors
from twinfer.runtime.loaders.weights import FLOAT_STORAGE, full_region

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fixtures_models import hf_model, write_gguf_like_llamacpp  # noqa: E402

from twinfer.backends.cuda.parallel.layout import ParallelConfig, RankPosition  # noqa: E402
from twinfer.backends.cuda.parallel.model import Sharded, ShardedModel  # noqa: E402
from twinfer.backends.cuda.parallel.shard import COLUMN, ROW, VOCAB, HostWeights, shard_request  # noqa: E402

# Boxes of a [6, 8, 64] tensor (experts, rows, columns) and of a [8, 64] matrix.
BOXES_3D = [(slice(2, 4),), (slice(None), slice(4, 8)), (slice(0, 3), slice(0, 4), slice(None)),
            (slice(1, 5), slice(None), slice(32, 64)), (slice(None), slice(2, 6), slice(5, 17))]  # fmt: skip
BOXES_2D = [(slice(0, 4),), (slice(4, 8),), (slice(None), slice(32, 64)), (slice(3, 5), slice(7, 9))]


# -- safetensors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_safetensors_region_equals_full_read_and_get_slice(tmp_path: Path, dtype: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"experts": torch.randn(6, 8, 64, generator=g), "matrix": torch.randn(8, 64, generator=g)}
    path = tmp_path / "w.safetensors"
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, str(path))
    stored = read_safetensors(path)
    with safe_open(str(path), framework="pt") as f:
        for name, boxes in (("experts", BOXES_3D), ("matrix", BOXES_2D)):
            t = stored[name]
            for box in boxes:
                got = t.read_region(full_region(box, t.shape))
                assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable
                np.testing.assert_array_equal(got, t.read()[box], err_msg=f"{name}{box}")
                np.testing.assert_array_equal(got, f.get_slice(name)[box].float().numpy(), err_msg=f"{name}{box}")


# -- GGUF ------------------------------------------------------------------------------------------
def _gguf_tensors(path: Path, type_name: str) -> dict[str, GGUFTensor]:
    """A GGUF file with an [6, 8, 64] and an [8, 64] tensor stored as `type_name`."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(path, "llama")
    for name, shape in (("experts", (6, 8, 64)), ("matrix", (8, 64))):
        values = rng.normal(size=shape).astype(np.float32)
        if type_name == "F32":
            w.add_tensor(name, values)
        elif type_name == "F16":
            w.add_tensor(name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    contents = read_gguf(path)
    return {name: GGUFTensor(name, path, info.shape, ggml_type_name(info.ggml_type), info.nbytes, info, contents)
            for name, info in contents.tensors.items()}  # fmt: skip


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0"])
def test_gguf_region_equals_full_read(tmp_path: Path, type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _gguf_tensors(tmp_path / "w.gguf", type_name)
    dequantized_rows: list[int] = []
    dequantize = GGUFTensor._dequantize

    def counting(self: GGUFTensor, rows: np.ndarray) -> np.ndarray:
        dequantized_rows.append(rows.shape[0])
        return dequantize(self, rows)

    monkeypatch.setattr(GGUFTensor, "_dequantize", counting)
    for name, boxes in (("experts", BOXES_3D), ("matrix", BOXES_2D)):
        t = tensors[name]
        assert t.dtype == type_name
        for box in boxes:
            region = full_region(box, t.shape)
            full = t.read()[box]
            dequantized_rows.clear()
            got = t.read_region(region)
            assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable
            np.testing.assert_array_equal(got, full, err_msg=f"{name}{box}")
            # float types are cut in the mapping; Q8_0 dequantizes only the rows the leading axes select
            rows = math.prod(r.stop - r.start for r in region[:-1])
            assert dequantized_rows == ([] if type_name in FLOAT_STORAGE else [rows])


# -- transforms: the canonical weight's region from its sources ------------------------------------
Reads = list[tuple[str, str, int]]  # (stored tensor name, "full" or "region", bytes)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Every read of a stored tensor (safetensors or GGUF) while the test runs, with its byte count."""
    log: Reads = []

    def wrap(cls: Any) -> None:
        read, read_region = cls.read, cls.read_region

        def full(self: Any) -> np.ndarray:
            log.append((self.name, "full", self.nbytes))
            return read(self)

        def region(self: Any, box: tuple[slice, ...]) -> np.ndarray:
            share = math.prod(r.stop - r.start for r in box) / math.prod(self.shape)
            log.append((self.name, "region", round(self.nbytes * share)))
            return read_region(self, box)

        monkeypatch.setattr(cls, "read", full)
        monkeypatch.setattr(cls, "read_region", region)

    wrap(SafetensorsTensor)
    wrap(GGUFTensor)
    return log


def test_gguf_unpermuted_heads_are_read_alone(tmp_path: Path, reads: Reads) -> None:
    write_gguf_like_llamacpp("llama", hf_model("llama"), tmp_path / "l.gguf")
    w = load_model(tmp_path / "l.gguf").weights
    D = w.spec.head_dim
    for name in ("layers.1.q", "layers.1.k"):
        assert w.transform(name) == ("unpermute_q" if name.endswith("q") else "unpermute_k")
        for box in [(slice(D, 2 * D),), (slice(0, 2 * D),), (slice(None), slice(8, 40))]:
            reads.clear()
            np.testing.assert_array_equal(w.load_region(name, box), w.load(name)[box])
            assert reads[0][1] == "region", f"{name}{box}: whole heads need no full read"
        reads.clear()  # half a head: the permutation needs the whole head, so the weight is read and cut
        np.testing.assert_array_equal(w.load_region(name, (slice(D // 2, D),)), w.load(name)[D // 2 : D])
        assert reads[0][1] == "full"


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE as transformers saves it (one tensor per expert)."""
    folder = tmp_path_factory.mktemp("moe")
    hf_model("qwen3_moe").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fused_moe_folder(moe_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with its experts fused as transformers 5 holds them: gate_up_proj [E, 2I, C]."""
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("fused")
    (folder / "config.json").write_text((moe_folder / "config.json").read_text())
    stored = read_safetensors(moe_folder / "model.safetensors")
    out = {k: t.read() for k, t in stored.items() if ".experts." not in k}
    moe = load_model(moe_folder).spec.moe
    assert moe is not None
    E = moe.num_experts
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        gate = [stored[f"{p}{e}.gate_proj.weight"].read() for e in range(E)]
        up = [stored[f"{p}{e}.up_proj.weight"].read() for e in range(E)]
        out[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up, strict=True)])
        out[p + "down_proj"] = np.stack([stored[f"{p}{e}.down_proj.weight"].read() for e in range(E)])
    save_file(out, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_regions_read_only_their_experts(moe_folder: Path, fused_moe_folder: Path, layout: str,
                                                reads: Reads) -> None:
    w = load_model(moe_folder if layout == "per_expert" else fused_moe_folder).weights
    for part in ("gate", "up", "down"):
        name = f"layers.1.experts.{part}"
        assert w.transform(name) == ("stack_experts" if layout == "per_expert" else
                                     {"gate": "gate_half", "up": "up_half", "down": None}[part])
        E, a, b = w.shape(name)
        box = (slice(2, 4), slice(0, a // 2)) if part != "down" else (slice(2, 4), slice(None), slice(b // 2, b))
        reads.clear()
        got = w.load_region(name, box)
        assert all(kind == "region" for _, kind, _ in reads)
        if layout == "per_expert":  # experts 2 and 3 only
            assert sorted(n.split(".")[5] for n, _, _ in reads) == ["2", "3"]
        assert sum(n for _, _, n in reads) == w.nbytes_stored(name) // 4  # half the experts, half the width
        np.testing.assert_array_equal(got, w.load(name)[box])


# -- ranks ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (4 heads, 2 KV heads, MLP width 80, untied head) saved as safetensors."""
    folder = tmp_path_factory.mktemp("llama")
    hf_model("llama").save_pretrained(folder)
    return folder


def build_rank(folder: Path, config: ParallelConfig, rank: int) -> ShardedModel:
    weights = load_model(folder).weights
    pos = RankPosition(config, rank, weights.spec.num_layers)
    return ShardedModel(weights.spec, pos, weights, device=torch.device("cpu"), dtype=torch.float32,
                        num_blocks=4, block_size=4)


def stored_names(folder: Path, keep: Callable[[str], bool]) -> set[str]:
    """The file's names of the canonical weights `keep` accepts."""
    w = load_model(folder).weights
    return {s.name for name in w.names() if keep(name) for s in w.sources(name)}


def test_tp_rank_reads_half_of_every_split_tensor(llama_folder: Path, reads: Reads) -> None:
    w = load_model(llama_folder).weights
    config = ParallelConfig(tp=2)
    rank = build_rank(llama_folder, config, 1)
    pos = rank.pos
    kinds = {name: shard_request(name, w.shape(name), w.spec, pos) for name in w.names()}
    file_of = {w.sources(name)[0].name: name for name in w.names()}
    by_tensor = {n: (kind, nbytes) for n, kind, nbytes in reads}
    assert len(by_tensor) == len(reads) == len(w.names())  # each weight read once
    split = 0
    for stored, (kind, nbytes) in by_tensor.items():
        part = kinds[file_of[stored]]
        assert part is not None
        if part.kind in (COLUMN, ROW, VOCAB):
            assert kind == "region" and nbytes * 2 == w.nbytes_stored(file_of[stored]), stored
            split += 1
        else:
            assert kind == "full", stored
    assert split == 2 + 7 * w.spec.num_layers  # embed, lm_head; q k v o gate up down per layer
    # the rank's weights are the full weights cut by the same rules (what every rank held before)
    host = HostWeights({name: w.load(name) for name in w.names()})
    spec = w.spec
    want = ShardedModel(spec, pos, host, device=torch.device("cpu"), dtype=torch.float32, num_blocks=4, block_size=4)
    assert rank.weights.keys() == want.weights.keys()
    for name, value in rank.weights.items():
        got, expected = (v.tensor if isinstance(v, Sharded) else v for v in (value, want.weights[name]))
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [0, 1])
def test_pp_stage_reads_nothing_of_the_other_stage(llama_folder: Path, stage: int, reads: Reads) -> None:
    config = ParallelConfig(pp=2)
    rank = build_rank(llama_folder, config, stage)
    mine = rank.pos.layers

    def owned(name: str) -> bool:
        if name.startswith("layers."):
            return int(name.split(".")[1]) in mine
        return (name == "embed") == (stage == 0)  # embed on the first stage; norm and lm_head on the last

    w = load_model(llama_folder).weights
    assert {n for n, _, _ in reads} == stored_names(llama_folder, owned)
    assert sum(n for _, _, n in reads) == sum(w.nbytes_stored(name) for name in w.names() if owned(name))


def test_expert_parallel_rank_reads_its_experts_slices(moe_folder: Path, reads: Reads) -> None:
    w = load_model(moe_folder).weights
    build_rank(moe_folder, ParallelConfig(tp=2, ep=2), 3)  # expert group 1, tp rank 1: experts 2, 3
    experts = [r for r in reads if ".experts." in r[0]]
    assert {n.split(".")[5] for n, _, _ in experts} == {"2", "3"}
    assert all(kind == "region" for _, kind, _ in experts)
    stored = sum(w.nbytes_stored(name) for name in w.names() if ".experts." in name)
    assert sum(n for _, _, n in experts) * 4 == stored  # half the experts, half of each one's width


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_streaming_reads_one_expert_and_no_more(moe_folder: Path, fused_moe_folder: Path,
                                                      layout: str) -> None:
    """`ExpertReader` (batch-1 expert streaming) returns exactly the loaded expert; a fused gate_up
    expert reads only the half it needs, so the bytes read are what `stored_bytes` counts."""
    from twinfer.runtime.experts import ExpertReader, _read_owned

    w = load_model(moe_folder if layout == "per_expert" else fused_moe_folder).weights
    reader = ExpertReader(w)
    read: list[int] = []
    import twinfer.runtime.experts as experts

    def counting(src: object) -> np.ndarray:
        read.append(src.nbytes)  # type: ignore[attr-defined]
        return _read_owned(src)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts, "_read_owned", counting)
        got = reader.read(1, 3)
    for part, value in zip(("gate", "up", "down"), got, strict=True):
        np.testing.assert_array_equal(value, w.load(f"layers.1.experts.{part}")[3])
    assert sum(read) == reader.stored_bytes(1, 3) == reader.stored_bytes(1, 0)
