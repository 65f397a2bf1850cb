"""What a KV hand-over bills (kv/connector.py, engine/bill.py): `kv_transferred` is the prompt's KV
alone (its tokens x the runner's per-token K+V bytes, the planner's figure), `kv_transfer_overhead`
everything else the decode replica received for it (llama.cpp's cell positions and per-layer
headers, the payload's own header), so the two add up to the bytes on the wire.

Two engines in this process per runner (torch, MLX, llama.cpp), a prefill and a decode replica, the KV
over loopback TCP.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.request import RequestOutput
from twinfer.runtime.kv.connector import KVConnector, KVPayload, KVTransferParams

pytest.importorskip("fastapi")  # app/pd.py, where attach_kv_connector lives

PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False),
                        kv_transfer_params={"do_remote_decode": True})


def _pair(runners: tuple[Any, Any], ctx: int) -> tuple[Engine, KVConnector, Engine, KVConnector]:
    from twinfer.app.pd import attach_kv_connector

    engines = [Engine(r, None, EngineConfig(max_seqs=2, max_context=ctx, replica=name))
               for r, name in zip(runners, ("prefill-0", "decode-0"), strict=True)]
    return engines[0], attach_kv_connector(engines[0]), engines[1], attach_kv_connector(engines[1])


def hand_over(prefill: Engine, store: KVConnector, decode: Engine, prompt: list[int]
              ) -> tuple[RequestOutput, KVPayload, int]:
    """Prefill `prompt` on one engine, decode 3 tokens on the other from its KV; returns the decode's
    output, the payload that crossed and its bytes on the wire (the 8-byte length prefix included)."""
    first = prefill.generate([prompt], PARAMS)[0]
    params = KVTransferParams.parse(first.kv_transfer_params)
    assert params is not None and params.transfer_id is not None and params.num_tokens == len(prompt)
    data = store.store.take(params.transfer_id)  # look at what waits, then put it back for the decoder
    assert data is not None
    store.store.put(params.transfer_id, data)
    out = decode.generate([prompt], replace(PARAMS, max_tokens=3, kv_transfer_params=first.kv_transfer_params))[0]
    assert out.cost is not None and out.cost["tokens"]["cached"]["remote"] == len(prompt), out.cost
    assert "kv_fallback" not in out.cost.get("route", {})
    return out, KVPayload.decode(data), 8 + len(data)


# -- torch and MLX: the payload is K then V of each layer, nothing else --------------------------------
def _tiny_moe(folder: Path) -> Any:
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe

    write_synthetic_moe(folder, SyntheticMoE(hidden=64, intermediate=32, layers=2, experts=4, top_k=2, vocab=96,
                                             heads=4, kv_heads=2, head_dim=16))
    return load_model(folder)


def _dense_runner(backend: str, loaded: Any, dtype: str = "float32") -> Any:
    if backend == "torch":
        pytest.importorskip("torch")
        import torch

        from twinfer.backends.cuda.runner import build_torch_runner

        return build_torch_runner(loaded.spec, loaded.weights, kv_tokens=256, dtype=getattr(torch, dtype))
    pytest.importorskip("mlx.core")
    from twinfer.backends.metal.runner import load_mlx_runner

    return load_mlx_runner(loaded, kv_tokens=256, dtype=dtype)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def dense_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Engine, KVConnector, Engine, KVConnector]]:
    loaded = _tiny_moe(tmp_path_factory.mktemp("tiny-moe"))
    pair = _pair((_dense_runner(request.param, loaded), _dense_runner(request.param, loaded)), 256)
    yield pair
    pair[1].close()
    pair[3].close()


@pytest.mark.parametrize("n", [5, 16, 37])
def test_dense_transfer_is_the_prompts_kv(dense_pair: tuple[Engine, KVConnector, Engine, KVConnector], n: int) -> None:
    prefill, store, decode, _ = dense_pair
    out, payload, wire = hand_over(prefill, store, decode, [(7 * i + n) % 96 for i in range(n)])
    per_token = decode.runner.spec.kv_bytes_per_token(4.0)  # float32 K and V, every layer
    assert decode.runner.traffic.kv_bytes_per_token == per_token
    cost = out.cost
    assert cost is not None
    assert cost["bytes"]["kv_transferred"] == n * per_token == payload.nbytes
    assert cost["bytes"]["kv_transfer_overhead"] == wire - n * per_token > 0  # the payload's header only


# -- llama.cpp: the sequence state's K/V rows, apart from its framing ------------------------------------
def _framing(n_caches: int, layers: int, cells: int) -> int:
    """llama.cpp's bytes around the K/V rows of a one-stream sequence state (kv_port.py's layout): magic and
    seq id; per cache n_stream, cell_count, v_trans, n_layer; 12 bytes a cell; a K and a V header a layer."""
    return 8 + 16 * n_caches + 12 * cells + 2 * 12 * layers


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def llama_pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, tuple[Engine, KVConnector, Engine, KVConnector]]]:
    pytest.importorskip("llama_cpp")
    from twinfer.app.models import open_model

    opened = [open_model(None, "llamacpp", max_seqs=2, ctx=1024, threads=1,
                         kv_type=request.param) for _ in range(2)]
    pair = _pair((opened[0].runner, opened[1].runner), 1024)
    yield request.param, pair
    for connector in (pair[1], pair[3]):
        connector.close()
    for o in opened:
        o.runner.close()


@pytest.mark.parametrize("n", [6, 16, 100, 600])
def test_llamacpp_transfer_is_the_prompts_kv(llama_pair: tuple[str, tuple[Engine, KVConnector, Engine, KVConnector]],
                                             n: int) -> None:
    from twinfer.backends.llamacpp.kv_port import parse_seq_state
    from twinfer.planners.cost import kv_bytes_per_seq
    from twinfer.planners.formats import KV_FORMATS
    from twinfer.planners.source import profile_from_loaded
    from twinfer.runtime.loaders import load_model

    kv_type, (prefill, store, decode, _) = llama_pair
    if n == 600 and kv_type != "f16":
        pytest.skip("past the window once is enough")
    out, payload, wire = hand_over(prefill, store, decode, [(37 * i + n) % 5000 + 100 for i in range(n)])
    spec = decode.runner.spec
    windows = [spec.window(i) for i in range(spec.num_layers)]
    assert None in windows and any(windows)  # the default model (Gemma 3) keeps a full and a window cache
    window = max(w for w in windows if w is not None)
    # the prompt's KV: every full layer at every position, a sliding layer at the window's (the planner's figure)
    planner = kv_bytes_per_seq(profile_from_loaded(load_model(None)), KV_FORMATS[kv_type], n)
    per_token = decode.runner.traffic.kv_bytes_per_token
    expected = sum(per_token / spec.num_layers * (n if w is None else min(n, w)) for w in windows)
    assert expected == pytest.approx(planner, rel=1e-9)
    if n <= window:
        assert expected == n * per_token
    cost = out.cost
    assert cost is not None
    assert cost["bytes"]["kv_transferred"] == round(expected)
    state = parse_seq_state(payload.layers[0])
    assert state.kv == cost["bytes"]["kv_transferred"] and state.cells == (n, min(n, window))
    assert state.framing == _framing(2, spec.num_layers, n + min(n, window)) == len(payload.layers[0]) - state.kv
    assert cost["bytes"]["kv_transfer_overhead"] == wire - state.kv  # llama.cpp's framing and the payload header


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_bfloat16_kv_crosses_bit_for_bit(backend: str, tmp_path: Path) -> None:
    """A bfloat16 cache (numpy has no such dtype) leaves and enters as its raw bits."""
    from twinfer.runtime.batch import SeqChunk, StepBatch

    loaded = _tiny_moe(tmp_path)
    src, dst = _dense_runner(backend, loaded, "bfloat16"), _dense_runner(backend, loaded, "bfloat16")
    n, table = 21, [3, 0, 7]  # blocks of 16: the two replicas' tables differ
    src.step(StepBatch([SeqChunk(0, [(5 * i) % 96 for i in range(n)], 0, [1, 2])]))
    assert src.kv_port is not None and dst.kv_port is not None and src.kv_port.format == dst.kv_port.format
    for layer in range(src.kv_port.num_layers()):
        data = src.kv_port.save_layer(layer, 0, [1, 2], n)
        assert len(data) == n * src.traffic.kv_bytes_per_token / src.kv_port.num_layers()
        dst.kv_port.load_layer(layer, 0, table, n, data)
        assert dst.kv_port.save_layer(layer, 0, table, n) == data
    assert np.frombuffer(data, dtype=np.uint16).any()  # real KV, not zeros


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_turboquant_kv_is_refused_when_the_connector_starts(backend: str, tmp_path: Path) -> None:
    from twinfer.app.pd import attach_kv_connector
    from twinfer.runtime.errors import TwinferError

    loaded = _tiny_moe(tmp_path)
    if backend == "torch":
        pytest.importorskip("torch")
        from twinfer.backends.cuda.runner import build_torch_runner

        runner = build_torch_runner(loaded.spec, loaded.weights, kv_tokens=64, kv_format="tq4")
    else:
        pytest.importorskip("mlx.core")
        from twinfer.backends.metal.runner import load_mlx_runner

        runner = load_mlx_runner(loaded, kv_tokens=64, kv_format="tq4")
    with pytest.raises(TwinferError, match="TurboQuant-coded KV cache cannot be handed"):
        attach_kv_connector(Engine(runner, None, EngineConfig(max_seqs=1, max_context=64)))
