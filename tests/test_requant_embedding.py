"""Requantizing the token embedding / output matrix with llama.cpp (`requantize_gguf(embed_type=)`).

Gemma 3 270M Q4_K_M ties a 262,144 x 640 Q8_0 embedding (63% of the weights) to its output. llama.cpp
applies `token_embedding_type` to that one tensor (it wins over `output_tensor_type`), and aborts the
process when given a K-quant whose 256-weight blocks do not divide the 640-wide rows, so
`requantize_gguf` passes the type llama.cpp's own fallback would choose. Measured figures are in
docs/quantization.md (`--memory-budget` on the default model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from twinfer.planners.formats import mix
from twinfer.planners.model import ModelProfile
from twinfer.planners.source import profile_from_loaded
from twinfer.runtime.loaders import load_model

# KL(stored || requantized) with the recipe of docs/quantization.md (F16 KV, 512 prose tokens, 256-token
# windows): only the table requantized (the fit of EMBED_KL_WEIGHT), then both with the projections (held out)
MEASURED_KL = {"q4_k_m+embed_q5_0": 0.042, "q4_k_m+embed_q4_0": 0.129, "q4_0+embed_q4_0": 0.549,
               "iq4_xs+embed_q5_0": 0.231}


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> ModelProfile:
    return profile_from_loaded(load_model(default_model))


def _types(path: Path) -> dict[str, tuple[str, int]]:
    """(ggml type, bytes) of every tensor, from the GGUF header (as gguf.GGUFReader reads them, 100x faster)."""
    w = load_model(path).weights
    return {n: (str(w.dtype_stored(n)).upper(), int(w.nbytes_stored(n))) for n in w.names()}


@pytest.fixture(scope="module")
def requantized(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("llama_cpp")
    from twinfer.backends.llamacpp.requantize import requantize_gguf

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWINFER_CACHE", str(cache))
        return {e: requantize_gguf(default_model, "q4_k_m", "MOSTLY_Q4_K_M", embed_type=e) for e in ("q5_0", "q6_k")}


def test_embedding_type_is_written(default_model: Path, requantized: dict[str, Path]) -> None:
    stored, q5 = _types(default_model), _types(requantized["q5_0"])
    assert "lm_head" not in q5  # tied: token_embd is the output matrix
    assert stored["embed"][0] == "Q8_0" and q5["embed"][0] == "Q5_0"
    assert q5["embed"][1] == 262144 * 640 * 11 // 16  # 5.5 bits per weight
    # the file's own mix: every other tensor is copied as stored
    assert {n: t for n, (t, _) in q5.items() if n != "embed"} == {n: t for n, (t, _) in stored.items() if n != "embed"}
    # Q6_K blocks (256) do not divide 640: written as Q8_0, what llama.cpp's fallback picks, instead of an abort
    assert _types(requantized["q6_k"])["embed"][0] == "Q8_0"
    assert requantized["q6_k"].name.endswith("-q4_k_m-embed-q8_0.gguf")  # cached apart from the Q5_0 file
    assert requantized["q5_0"].name.endswith("-q4_k_m-embed-q5_0.gguf")


def test_planner_bytes_match_the_written_file(gemma: ModelProfile, requantized: dict[str, Path]) -> None:
    written = sum(b for _, b in _types(requantized["q5_0"]).values())
    predicted = gemma.weight_bytes(mix("q4_k_m+embed_q5_0"))
    assert predicted == pytest.approx(written, rel=0.03)
    assert written < 0.75 * gemma.weight_bytes(gemma.stored)  # type: ignore[arg-type]  # 184 MB of 247 MB
    assert dict(gemma.split(mix("q4_k_m+embed_q6_k"), "embed")) == {"q8_0": 1.0}


def test_requantized_embedding_runs(default_model: Path, requantized: dict[str, Path]) -> None:
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner
    from twinfer.quant.fidelity import RunnerSource, corpus_windows
    from twinfer.quant.kl import KLAccumulator

    stored = LlamaCppRunner(default_model, LlamaCppOptions(n_ctx=256, max_seqs=1))
    small = LlamaCppRunner(requantized["q5_0"], LlamaCppOptions(n_ctx=256, max_seqs=1))
    acc = KLAccumulator()
    for w in corpus_windows(str(default_model), "prose", 95, 48):
        acc.add(RunnerSource(stored).logits(w)[:-1], RunnerSource(small).logits(w)[:-1])
    report = acc.report("stored", "embed q5_0", "prose")
    assert 0.0 < report.mean_kl < 0.15 and report.top1_agreement > 0.75  # 0.042 and 88.7% on 512 tokens


def test_embedding_kl_follows_measurements(gemma: ModelProfile) -> None:
    kl = {name: gemma.mix_kl(mix(name)) for name in MEASURED_KL}
    for name, measured in MEASURED_KL.items():
        assert measured / 1.3 < kl[name] < measured * 1.3, name
    assert kl["q4_k_m+embed_q5_0"] < kl["q4_k_m+embed_q4_0"] < kl["iq4_xs+embed_q5_0"] < kl["q4_0+embed_q4_0"]


def test_budget_strategy_requantizes_the_embedding(default_model: Path) -> None:
    from pinned_host import pinned_cpu

    from twinfer.app.budget import llamacpp_strategy

    # a budget is the model's: the interpreter's ~150 MB comes on top of it
    s = llamacpp_strategy(load_model(default_model), 250_000_000, 1024, 1, False, hardware=pinned_cpu())
    assert (s.requantize, s.embed_type) == ("q4_k_m", "q5_0")
    # the KV format is a speed/KL trade that differs by machine (Q8_0 on this laptop, F16 on an M2 Max)
    assert s.kv_type in ("f16", "q8_0")
    assert 200e6 < s.predicted_bytes <= 250e6  # 184 MB of weights, 10-19 MB of KV and the workspace
    assert "token embedding and output matrix in Q5_0" in s.summary()


# VmHWM is this process's own peak: ru_maxrss would include the forking test process's size.
_REQUANT_CHILD = """
import sys
from pathlib import Path
from twinfer.backends.llamacpp.requantize import requantize_gguf
requantize_gguf(Path(sys.argv[1]), "q4_k_m", "MOSTLY_Q4_K_M", embed_type="q5_0")
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


def test_streamed_embedding_stays_in_budget_and_equals_llama_cpp(default_model: Path, requantized: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """The embedding is re-encoded a few MB of rows at a time after llama.cpp copies it: the bytes are the
    ones llama.cpp writes when it converts the whole 671 MB float32 table, at a fraction of the memory."""
    import subprocess
    import sys

    if not Path("/proc/self/status").is_file():
        pytest.skip("peak memory is read from Linux's /proc")
    from twinfer.backends.llamacpp._lib import load_llama_cpp, set_quiet
    from twinfer.quant.gguf_rewrite import TypedGGUF

    env = {**__import__("os").environ, "TWINFER_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _REQUANT_CHILD, str(default_model)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    peak_mb = int(proc.stdout.split()[-1]) / 1024  # kB
    assert peak_mb < 400, peak_mb  # the --memory-budget this file's plan was made for (llama.cpp alone: ~900)

    lib = load_llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = lib.LLAMA_FTYPE_MOSTLY_Q4_K_M, True
    params.token_embedding_type = params.output_tensor_type = 6  # GGML_TYPE_Q5_0, whole-tensor in llama.cpp
    reference = tmp_path / "reference.gguf"
    set_quiet(lib, True)
    assert lib.llama_model_quantize(str(default_model).encode(), str(reference).encode(), params) == 0
    ours, theirs = TypedGGUF(requantized["q5_0"]), TypedGGUF(reference)
    assert list(ours.tensors) == list(theirs.tensors)
    for name, info in theirs.tensors.items():
        mine = ours.tensors[name]
        assert (mine.ggml_type, mine.shape) == (info.ggml_type, info.shape), name
        assert bytes(ours.tensor_bytes(mine)) == bytes(theirs.tensor_bytes(info)), name
