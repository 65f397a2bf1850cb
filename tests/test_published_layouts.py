"""Published pre-quantized checkpoint layouts load as published (runtime/loaders/published.py).

Each layout gets a tiny random-weight model written by an independent writer: DeepSeek block FP8
with torch's own float8 cast (DeepSeek's reference recipe), compressed-tensors FP8 and NVFP4 with
the `compressed-tensors` library's compressors, ModelOpt NVFP4 from the same packed bytes under
ModelOpt's names, gpt-oss MXFP4 and mlx-community affine int4/int8 with MLX's `mx.quantize`. The
reference is transformers running the writer's own dequantized weights. twinfer's logits must match
it within TOL on torch (local: dequantized at load; datacenter: kept packed, dequantized per matmul)
and on MLX; on the datacenter target every quantized weight holds exactly its published bytes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders import load_model
from twinfer.runtime.loaders.published import PackedTensor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
pytest.importorskip("compressed_tensors", reason="the test extra installs compressed-tensors, the writer")

from safetensors.torch import save_file  # noqa: E402

from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.backends.metal.runner import build_mlx_runner  # noqa: E402

TOL = 2e-4  # same weights on both sides: only float32 summation order differs
BLOCK = 4
PROMPT = [3, 17, 99, 5, 64, 120, 8, 41, 77, 2, 56]
DECODE_STEPS = 3
BASE = dict(vocab_size=128, hidden_size=64, max_position_embeddings=256, attn_implementation="eager",
            num_hidden_layers=2, num_attention_heads=4)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", dict(BASE, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False)),
    "deepseek_v3": ("DeepseekV3", dict(BASE, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                                       n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
                                       qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_key_value_heads=4,
                                       n_group=1, topk_group=1, first_k_dense_replace=1)),
    "gpt_oss": ("GptOss", dict(BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                               num_key_value_heads=2, sliding_window=4)),
}  # fmt: skip


@cache
def base_model(kind: str) -> Any:
    prefix, kwargs = CONFIGS[kind]
    config = getattr(transformers, prefix + "Config")(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.5 if "embed" in name else 0.15)
    return model


def is_linear(name: str, p: Any) -> bool:
    """The projections a published checkpoint quantizes (not embeddings, norms, routers or the head)."""
    return p.dim() == 2 and name.endswith("proj.weight") and ".layers." in name


Writer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]  # w -> (suffix: tensor, dequantized)


def write(folder: Path, kind: str, writer: Writer, quant: dict[str, Any], config_key: str = "quantization_config",
          split_experts: bool = False) -> Any:
    """Save `kind`'s model with its linears in the writer's layout; returns transformers on the dequantized weights."""
    ref = copy.deepcopy(base_model(kind))
    state = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
    for name, p in list(ref.named_parameters()):
        if split_experts and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state.pop(name)  # published: one linear per expert (DeepSeek's layout), [E, out, in] stacked here
            module = name.rsplit(".", 1)[0]
            deq = []
            halves = [("gate_proj", 0), ("up_proj", 1)] if name.endswith("gate_up_proj") else [("down_proj", None)]
            for e in range(p.shape[0]):
                rows = []
                for proj, half in halves:
                    w = p[e] if half is None else p[e].chunk(2, dim=0)[half]
                    parts, d = writer(w.detach())
                    state |= {f"{module}.{e}.{proj}.{k}": v for k, v in parts.items()}
                    rows.append(d)
                deq.append(torch.cat(rows))
            with torch.no_grad():
                p.copy_(torch.stack(deq))
            continue
        if not is_linear(name, p):
            continue
        parts, deq = writer(p.detach())
        state.pop(name)
        state |= {f"{name[: -len('weight')]}{k}": v for k, v in parts.items()}
        with torch.no_grad():
            p.copy_(deq)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config = json.loads(ref.config.to_json_string())
    config[config_key] = quant
    (folder / "config.json").write_text(json.dumps(config))
    return ref


def run(runner: Any, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    table = list(range(16))
    rows = [runner.step(StepBatch([SeqChunk(0, prompt, 0, table, LogitsWanted.ALL)]))]
    new: list[int] = []
    for _ in range(DECODE_STEPS):
        new.append(int(rows[-1][-1].argmax()))
        rows.append(runner.step(StepBatch([SeqChunk(0, [new[-1]], len(prompt) + len(new) - 1, table)])))
    return np.concatenate(rows), new


def check(folder: Path, ref: Any, formats: set[str]) -> dict[str, Any]:
    """Logits of every path against transformers; the datacenter runner's resident bytes. Returns them."""
    loaded = load_model(folder)
    names = loaded.weights.names()
    kept = {n: f for n in names if (f := loaded.weights.format_of(n)) is not None}  # type: ignore[attr-defined]
    assert set(kept.values()) == formats
    weights = {n: loaded.weights[n] for n in names}  # what a runner holds: packed where kept
    runners = {
        "torch-local": build_torch_runner(loaded.spec, weights, kv_tokens=64, block_size=BLOCK),
        "torch-datacenter": build_torch_runner(loaded.spec, weights, kv_tokens=64, block_size=BLOCK,
                                               packed_weights=True),
        "mlx": build_mlx_runner(loaded.spec, weights, kv_tokens=64, block_size=BLOCK),
    }
    out: dict[str, Any] = {}
    for label, runner in runners.items():
        rows, new = run(runner, PROMPT)
        with torch.no_grad():
            expect = ref(torch.tensor([PROMPT + new])).logits[0].float().numpy()[: len(rows)]
        out[label] = float(np.abs(rows - expect).max())
        print(f"{folder.name} {label}: max |dlogit| = {out[label]:.2e}")
        assert out[label] <= TOL, (label, out[label])
    dc = runners["torch-datacenter"].weights
    stored = {n: loaded.weights.nbytes_stored(n) for n in kept}
    resident = {n: int(dc[n].nbytes) for n in kept if f"{kept[n]}" not in ("int4", "int8")}
    for n, size in resident.items():
        assert not isinstance(dc[n], torch.Tensor), n  # kept packed, not a dense tensor
        assert size == stored[n], (n, size, stored[n])
    out["resident"], out["stored"] = sum(resident.values()), sum(stored[n] for n in resident)
    out["float32"] = sum(4 * int(np.prod(loaded.weights.shape(n))) for n in resident)
    print(f"{folder.name} datacenter: {out['resident']} bytes resident for {out['stored']} published "
          f"({out['float32']} as float32)")
    return out


# -- the writers -----------------------------------------------------------------------------------
def deepseek_fp8(w: torch.Tensor, block: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DeepSeek-V3's weight_quant: one scale = amax / 448 per 128x128 tile, codes = (w / scale) cast to e4m3."""
    out, inp = w.shape
    bo, bi = -(-out // block), -(-inp // block)
    pad = torch.zeros(bo * block, bi * block)
    pad[:out, :inp] = w
    s = pad.view(bo, block, bi, block).abs().amax(dim=(1, 3)) / 448.0  # [bo, bi]
    full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    codes = (w / full).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": s.float()}, codes.float() * full


def ct_writer(preset: str, fmt: str) -> tuple[Writer, dict[str, Any]]:
    """compressed-tensors' own compressor for `preset`, and the config it writes."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme(preset, ["Linear"])
    comp = BaseCompressor.get_value_from_registry(fmt)
    args = scheme.weights

    def writer(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = w.float()
        sd = {"weight": w}
        if args.strategy == "tensor_group":
            gs = generate_gparam(w.min(), w.max())
            g = w.unflatten(-1, (w.shape[1] // args.group_size, args.group_size))
            sd["weight_scale"], _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
            sd["weight_global_scale"] = gs
        elif args.strategy == "block":  # min/max per tile, edge tiles partial
            b = args.block_structure[0]
            tiles = [[w[i : i + b, j : j + b] for j in range(0, w.shape[1], b)] for i in range(0, w.shape[0], b)]
            lo = torch.tensor([[t.min() for t in row] for row in tiles])
            hi = torch.tensor([[t.max() for t in row] for row in tiles])
            sd["weight_scale"], _ = calculate_qparams(lo, hi, args)
        elif args.strategy == "channel":
            sd["weight_scale"], _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        else:
            sd["weight_scale"], _ = calculate_qparams(w.amin(), w.amax(), args)
        parts = dict(comp.compress(sd, scheme))
        if "weight_packed" in parts:  # the library's NVFP4 decompress rounds to bf16: its steps in float32
            q = unpack_fp4_from_uint8(parts["weight_packed"], *w.shape, dtype=torch.float32)
            deq = dequantize(x_q=q, scale=parts["weight_scale"].float(), args=args,
                             global_scale=parts["weight_global_scale"],
                             dtype=torch.float32)
        else:
            deq = comp.decompress(parts, scheme)["weight"].float()
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            parts["input_scale"] = torch.tensor([0.02])  # a static activation scale: read past
        if preset == "NVFP4":
            parts["input_global_scale"] = torch.tensor([100.0])
        return {k: v.contiguous() for k, v in parts.items()}, deq

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"]).model_dump(mode="json")
    return writer, config


def modelopt_nvfp4() -> Writer:
    """ModelOpt's names over compressed-tensors' NVFP4 bytes: the same nibble order and E4M3 block
    scales; `weight_scale_2` is the multiplier, the reciprocal of compressed-tensors' global scale."""
    ct, _ = ct_writer("NVFP4", "nvfp4-pack-quantized")

    def writer(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        parts, deq = ct(w)
        return {"weight": parts["weight_packed"], "weight_scale": parts["weight_scale"],
                "weight_scale_2": (1.0 / parts["weight_global_scale"]).reshape(()),
                "input_scale": torch.tensor(0.02)}, deq

    return writer


def mlx_affine(bits: Callable[[tuple[int, ...]], tuple[int, int]]) -> Writer:
    """`mx.quantize` (mlx-lm's quantizer), scales and biases stored as float16 like mlx-community's."""

    def writer(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        b, g = bits(tuple(w.shape))
        wq, scales, biases = mx.quantize(mx.array(w.float().numpy()), group_size=g, bits=b)
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
        f32 = scales.astype(mx.float32), biases.astype(mx.float32)  # in float16 the output rounds too
        deq = mx.dequantize(wq, *f32, group_size=g, bits=b)
        t = {k: torch.from_numpy(np.array(v)) for k, v in (("weight", wq), ("scales", scales), ("biases", biases))}
        return t, torch.from_numpy(np.array(deq))

    return writer


# -- the layouts -----------------------------------------------------------------------------------
def test_deepseek_block_fp8(tmp_path: Path) -> None:
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    ref = write(tmp_path / "ds-fp8", "deepseek_v3", deepseek_fp8, quant, split_experts=True)
    got = check(tmp_path / "ds-fp8", ref, {"fp8-block"})
    assert got["resident"] == got["stored"] and got["resident"] < got["float32"] / 3
    from twinfer.planners.source import profile_from_loaded

    assert profile_from_loaded(load_model(tmp_path / "ds-fp8")).stored.label == "FP8 (as stored)"  # what plan sees


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8", "FP8_BLOCK"])  # channel; tensor (static input); 128x128
def test_compressed_tensors_fp8(tmp_path: Path, preset: str) -> None:
    writer, quant = ct_writer(preset, "float-quantized")
    ref = write(tmp_path / preset, "llama", writer, quant)
    got = check(tmp_path / preset, ref, {"fp8-block" if preset == "FP8_BLOCK" else "fp8"})
    assert got["resident"] == got["stored"] and got["resident"] < got["float32"] / 3


def test_compressed_tensors_nvfp4(tmp_path: Path) -> None:
    writer, quant = ct_writer("NVFP4", "nvfp4-pack-quantized")
    ref = write(tmp_path / "ct-nvfp4", "llama", writer, quant)
    got = check(tmp_path / "ct-nvfp4", ref, {"nvfp4"})
    assert got["resident"] == got["stored"] and got["resident"] < got["float32"] / 7  # 4.5 bits a weight


@pytest.mark.parametrize("where", ["config", "hf_quant_config.json"])
def test_modelopt_nvfp4(tmp_path: Path, where: str) -> None:
    folder = tmp_path / "modelopt"
    quant = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
             "exclude_modules": ["lm_head"]}
    ref = write(folder, "llama", modelopt_nvfp4(), quant)
    if where != "config":  # ModelOpt's own export: the options in hf_quant_config.json beside the model
        config = json.loads((folder / "config.json").read_text())
        del config["quantization_config"]
        (folder / "config.json").write_text(json.dumps(config))
        producer = {"producer": {"name": "modelopt", "version": "0.29.0"}}
        (folder / "hf_quant_config.json").write_text(json.dumps(producer | {"quantization": quant}))
        loaded = load_model(folder)  # the same bytes as the config variant, whose logits are checked
        assert {loaded.weights.format_of(n) for n in loaded.weights.names()} == {"nvfp4", None}
        q = loaded.weights["layers.0.q"]
        np.testing.assert_array_equal(q.dequantize(), ref.get_parameter("model.layers.0.self_attn.q_proj.weight")
                                      .detach().numpy())
        return
    got = check(folder, ref, {"nvfp4"})
    assert got["resident"] == got["stored"]


def test_gpt_oss_mxfp4_stays_mxfp4(tmp_path: Path) -> None:
    """gpt-oss's `*_blocks`/`*_scales` experts written from `mx.quantize(mode="mxfp4")`'s bytes."""
    folder = tmp_path / "gpt-oss"
    ref = copy.deepcopy(base_model("gpt_oss"))
    state = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
    for name, p in ref.named_parameters():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        blocks, scales, deq = [], [], []
        for w in p.detach():  # transformers' [in, out] -> the checkpoint's [out, in]
            wq, s = mx.quantize(mx.array(w.T.float().contiguous().numpy()), group_size=32, bits=4, mode="mxfp4")[:2]
            out, inp = w.shape[1], w.shape[0]
            blocks.append(np.array(wq).view(np.uint8).reshape(out, inp // 32, 16))
            scales.append(np.array(s))
            deq.append(np.array(mx.dequantize(wq, s, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)).T)
        state.pop(name)
        state[name + "_blocks"] = torch.from_numpy(np.stack(blocks))
        state[name + "_scales"] = torch.from_numpy(np.stack(scales))
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.stack(deq)))
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads(ref.config.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    got = check(folder, ref, {"mxfp4"})
    assert got["resident"] == got["stored"] and got["resident"] < got["float32"] / 7


def test_mlx_community_affine(tmp_path: Path) -> None:
    """int4 in groups of 64 with one module at int8 in groups of 32 (a per-module override), the
    embedding and the head quantized too, as mlx-lm writes them."""
    folder = tmp_path / "mlx"
    ref = write(folder, "llama", mlx_affine(lambda s: (8, 32) if s == (64, 128) else (4, 64)),
                {"group_size": 64, "bits": 4}, config_key="quantization")
    config = json.loads((folder / "config.json").read_text())
    downs = {f"model.layers.{i}.mlp.down_proj": {"group_size": 32, "bits": 8} for i in range(2)}
    config["quantization"] |= downs
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens", "lm_head"):  # quantized like the linears, with their own parts
        parts, deq = mlx_affine(lambda s: (4, 64))(state.pop(name + ".weight"))
        state |= {f"{name}.{k}": v for k, v in parts.items()}
        with torch.no_grad():
            ref.get_parameter(name + ".weight").copy_(deq)
    save_file(state, str(folder / "model.safetensors"))
    loaded = load_model(folder)
    assert loaded.weights.format_of("layers.0.down") == "int8" and loaded.weights.format_of("layers.0.q") == "int4"
    assert loaded.weights.format_of("embed") is None  # looked up by rows: dequantized
    check(folder, ref, {"int4", "int8"})
    # the app's path (load_mlx_runner / load_torch_runner) keeps the codes: mx.quantized_matmul on MLX
    from twinfer.backends.cuda.quant import TorchAffineLinear
    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.backends.metal.quant import MlxAffineLinear
    from twinfer.backends.metal.runner import load_mlx_runner

    assert isinstance(load_mlx_runner(loaded, kv_tokens=64, block_size=BLOCK).weights["layers.0.q"], MlxAffineLinear)
    assert isinstance(load_torch_runner(loaded, kv_tokens=64, block_size=BLOCK).weights["layers.0.q"],
                      TorchAffineLinear)
    dense = loaded.weights.load("layers.0.q")  # float readers (quantize, prune, shards) get float32
    assert isinstance(dense, np.ndarray) and dense.dtype == np.float32


def test_packed_tensor_reads_dequantized(tmp_path: Path) -> None:
    """A float reader (the runtime alone, no decoder) gets the writer's dequantized values."""
    writer, quant = ct_writer("FP8_DYNAMIC", "float-quantized")
    ref = write(tmp_path / "ct", "llama", writer, quant)
    loaded = load_model(tmp_path / "ct")
    src = loaded.weights.sources("layers.0.q")[0]
    assert isinstance(src, PackedTensor) and src.fmt == "fp8"
    expect = ref.get_parameter("model.layers.0.self_attn.q_proj.weight").detach().numpy()
    np.testing.assert_array_equal(src.read(), expect)


# -- refusals --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ct_fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ct-fp8")
    writer, quant = ct_writer("FP8_DYNAMIC", "float-quantized")
    write(base, "llama", writer, quant)
    return base


def _folder_with(tmp_path: Path, base: Path, change: Callable[[dict[str, Any]], None], name: str = "bad") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


REFUSALS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "unknown method": (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}),
                       "quantization_config.quant_method='awq'"),
    "fp8 rectangular blocks": (lambda c: c.update(quantization_config={"quant_method": "fp8",
                                                                       "weight_block_size": [64, 128]}),
                               "quantization_config.weight_block_size=[64, 128]"),
    "fp8 e5m2": (lambda c: c.update(quantization_config={"quant_method": "fp8", "fmt": "e5m2",
                                                         "weight_block_size": [128, 128]}),
                 "quantization_config.fmt='e5m2'"),
    "ct int4": (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int"),
                "quantization_config.config_groups.group_0.weights.type='int'"),
    "ct format": (lambda c: c["quantization_config"].update(format="pack-quantized"),
                  "quantization_config.format='pack-quantized'"),
    "ct kv cache": (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8}),
                    "quantization_config.kv_cache_scheme="),
    "modelopt algo": (lambda c: c.update(quantization_config={"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}),
                      "quantization_config.quant_algo='W4A8_AWQ'"),
    "mlx bits": (lambda c: c.update(quantization={"group_size": 64, "bits": 3}), "quantization.bits=3"),
    "mlx mode": (lambda c: c.update(quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"}),
                 "quantization.mode='mxfp4'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_field(tmp_path: Path, ct_fp8_folder: Path, case: str) -> None:
    change, field = REFUSALS[case]
    folder = _folder_with(tmp_path, ct_fp8_folder, change)
    with pytest.raises(ModelError) as err:
        load_model(folder)
    assert field in str(err.value), str(err.value)


def test_fp8_weight_without_scale_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "noscale"
    write(folder, "llama", lambda w: ({"weight": w.to(torch.float8_e4m3fn)}, w.to(torch.float8_e4m3fn).float()),
          {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    with pytest.raises(ModelError, match="FP8 without a scale tensor"):
        load_model(folder)
