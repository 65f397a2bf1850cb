"""GGUF export of quantized folders (quant/gguf_export.py): the default model with int4 (group 32),
mxfp4 and int8 layers exported and run by llama.cpp against the torch backend running the folder;
the stored blocks against the folder's values; llama Q/K rows permuted back; the refusals."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from typer.testing import CliRunner  # noqa: E402

from twinfer.cli.main import app  # noqa: E402
from twinfer.quant.gguf_export import GGUF_FILE, export_gguf  # noqa: E402
from twinfer.quant.model_io import QuantizedView, quantizable, write_quantized  # noqa: E402
from twinfer.runtime.errors import TwinferError  # noqa: E402
from twinfer.runtime.loaders import default_model_path, load_model  # noqa: E402
from twinfer.runtime.loaders.gguf_reader import GGUFContents, ggml_type_name  # noqa: E402

TOKENS = 32
# What each format becomes; layers 9-17 stay as stored (Q5_0/Q4_K/Q6_K/Q8_0).
LAYERS = {**dict.fromkeys(range(6), "int4"), 6: "mxfp4", 7: "mxfp4", 8: "int8"}
GGUF_TYPE = {"int4": "Q4_1", "mxfp4": "MXFP4", "int8": "Q8_0"}
_GGUF = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
         "down": "ffn_down"}  # fmt: skip


def _gguf_name(name: str) -> str:
    _, layer, proj = name.split(".")
    return f"blk.{layer}.{_GGUF[proj]}.weight"


def _folder(out: Path, source: Path, assignment: dict[str, str]) -> Path:
    loaded = load_model(source)
    write_quantized(out, loaded.spec, QuantizedView(loaded.weights, assignment, group_size=32), source)
    return out


@pytest.fixture(scope="module")
def assignment() -> dict[str, str]:
    names = quantizable(load_model(None).weights)
    return {n: LAYERS[int(n.split(".")[1])] for n in names if int(n.split(".")[1]) in LAYERS}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, assignment: dict[str, str]) -> tuple[Path, dict]:
    folder = _folder(tmp_path_factory.mktemp("gguf") / "q", default_model_path(), assignment)
    r = CliRunner().invoke(app, ["quantize", str(folder), "--gguf", "--gguf-int8-q8_0", "--json"])
    assert r.exit_code == 0, r.output
    return folder, json.loads(r.output.strip().splitlines()[-1])


def test_export_types_bytes_and_metadata(exported: tuple[Path, dict], assignment: dict[str, str]) -> None:
    folder, report = exported
    src, out = GGUFContents(default_model_path()), GGUFContents(folder / GGUF_FILE)
    assert list(out.tensors) == list(src.tensors)
    wanted = {_gguf_name(n): GGUF_TYPE[f] for n, f in assignment.items()}
    for name, info in out.tensors.items():
        if name in wanted:
            assert ggml_type_name(info.ggml_type) == wanted[name], name
            per_block = {"Q4_1": 20, "MXFP4": 17, "Q8_0": 34}[wanted[name]]
            assert info.nbytes == int(np.prod(info.ne)) // 32 * per_block
        else:  # e.g. token_embd Q8_0: the source's bytes, untouched
            assert info.ggml_type == src.tensors[name].ggml_type, name
            assert np.array_equal(out.tensor_bytes(info), src.tensor_bytes(src.tensors[name])), name
    assert report["types"] == {"Q4_1": 42, "MXFP4": 14, "Q8_0": 7} and report["kept"] == len(src.tensors) - 63
    assert report["bytes"] == (folder / GGUF_FILE).stat().st_size
    assert 0 < report["max_abs_change"]["int4"] < 2e-3 and report["max_abs_change"]["mxfp4"] == 0.0
    for key, value in src.metadata.items():
        if key != "general.file_type":
            assert out.metadata[key] == value, key
    # Q4_1 now holds 6 of 18 layers (33 M weights), more than Q5_0 (31 M), the largest type left
    assert report["file_type"] == "MOSTLY_Q4_1" and out.metadata["general.file_type"] == 3 != src.metadata["general.file_type"]
    for key in src.array_lengths:  # the tokenizer's vocabulary, scores, token types
        assert np.array_equal(np.asarray(out.array(key)), np.asarray(src.array(key))), key


def test_blocks_dequantize_to_the_folders_values(exported: tuple[Path, dict]) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    folder, _ = exported
    ours, out = load_model(folder).weights, GGUFContents(folder / GGUF_FILE)
    for name in ("layers.0.q", "layers.3.down", "layers.6.gate"):
        qw = ours.load(name)
        info = out.tensors[_gguf_name(name)]
        raw = out.tensor_bytes(info).reshape(info.shape[0], -1)
        got = dequantize(raw, GGMLQuantizationType(info.ggml_type))
        want = qw.dequantize()
        if qw.fmt == "mxfp4":
            assert np.array_equal(got, want), name  # the same scale bytes and codes
            continue
        p = qw.packed
        assert p.group_size == 32
        # float16 rounding of scale and bias (half an ulp, 2**-11 relative) is the only change
        bound = (15 * np.abs(p.scales) + np.abs(p.biases)) * 2.0**-11 * 1.001
        err = np.abs(got - want).reshape(*p.scales.shape, 32)
        assert (err <= bound[..., None] + 1e-9).all() and err.max() > 0, name


def test_llamacpp_runs_the_export_like_torch_runs_the_folder(exported: tuple[Path, dict]) -> None:
    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner
    from twinfer.quant.fidelity import RunnerSource, corpus_windows
    from twinfer.quant.kl import KLAccumulator

    folder, _ = exported
    window = next(corpus_windows(None, "prose", TOKENS, TOKENS + 1))
    spec = load_model(folder).spec
    torch_logits = RunnerSource(load_torch_runner(load_model(folder), kv_tokens=64)).logits(window)[:-1]

    def kl(path: Path) -> float:
        with LlamaCppRunner(path, LlamaCppOptions(n_ctx=256, max_seqs=1), spec=spec) as runner:
            logits = RunnerSource(runner).logits(window)[:-1]
        acc = KLAccumulator()
        acc.add(torch_logits, logits)
        return acc.report("torch folder", str(path), "prose").mean_kl

    exported_kl, source_kl = kl(folder / GGUF_FILE), kl(default_model_path())
    print(f"KL(torch folder || llama.cpp export) {exported_kl:.5f}, || llama.cpp source {source_kl:.5f}")
    assert exported_kl < 0.02  # measured 0.0032; llama.cpp's own arithmetic floor is ~0.006 on 512 tokens
    assert source_kl > 5 * exported_kl  # the export runs the folder's weights, not the source's


@cache
def _llama_gguf(root: Path) -> Path:
    from fixtures_models import hf_model, write_gguf_like_llamacpp

    path = root / "llama.gguf"
    write_gguf_like_llamacpp("llama", hf_model("llama"), path)
    return path


def test_llama_rope_rows_are_permuted_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr("twinfer.quant.model_io.write_tokenizer", lambda source, out: None)  # it has none
    source = _llama_gguf(tmp_path)
    folder = _folder(tmp_path / "q", source, {"layers.0.q": "int4", "layers.1.k": "int4", "layers.1.v": "int4"})
    export_gguf(folder, tmp_path / "out.gguf")
    ours, back = load_model(folder).weights, load_model(tmp_path / "out.gguf").weights  # the loader un-permutes
    for name in ("layers.0.q", "layers.1.k", "layers.1.v"):
        want = ours.load(name).dequantize()
        assert np.allclose(back.load(name), want, rtol=0, atol=2e-3 * np.abs(want).max()), name
    assert np.array_equal(back.load("layers.0.k"), load_model(source).weights.load("layers.0.k"))


def test_refusals_name_the_formats_and_what_to_do(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "q", default_model_path(),
                     {"layers.0.q": "tq4", "layers.0.k": "fp8", "layers.0.v": "int8", "layers.0.o": "int4"})
    with pytest.raises(TwinferError) as e:
        export_gguf(folder, tmp_path / "x.gguf")
    msg = str(e.value)
    assert "fp8: layers.0.k" in msg and "int8: layers.0.v" in msg and "tq4: layers.0.q" in msg
    assert "int4 (Q4_1), mxfp4 (MXFP4)" in msg and "--gguf-int8-q8_0" in msg
    with pytest.raises(TwinferError, match=r"\(fp8: layers.0.k; tq4: layers.0.q\)"):
        export_gguf(folder, tmp_path / "x.gguf", int8_as_q8_0=True)
    assert not (tmp_path / "x.gguf").exists()


def test_hf_sources_refuse_before_any_work(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from test_quant_backends import tiny_gemma

    hf = tiny_gemma(tmp_path / "tiny")
    r = CliRunner().invoke(app, ["quantize", str(hf), "--out", str(tmp_path / "x"), "--budget", "5",
                                 "--formats", "int4", "--gguf"])
    assert r.exit_code != 0 and isinstance(r.exception, TwinferError)
    assert "Hugging Face folder" in str(r.exception) and "convert_hf_to_gguf.py" in str(r.exception)
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(app, ["quantize", str(default_model_path()), "--out", str(tmp_path / "x"),
                                 "--budget", "5", "--formats", "int4,tq3", "--gguf"])
    assert isinstance(r.exception, TwinferError) and "--gguf: tq3 in --formats" in str(r.exception)
    folder = _folder(tmp_path / "q", hf, {"layers.0.q": "int4"})
    with pytest.raises(TwinferError, match="convert_hf_to_gguf.py"):
        export_gguf(folder, tmp_path / "x.gguf")
