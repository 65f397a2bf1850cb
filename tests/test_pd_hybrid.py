"""Prefill/decode hand-over of a recurrent hybrid (qwen3_next) on torch and MLX: the KV of its
full-attention layers and the conv + delta state of its linear-attention layers travel together
(test_pd.py's replicas and proxy).

The decode replica must continue from the handed-over state without recomputing a prompt token, and
its greedy text must equal one server's; the bytes moved are the attention layers' K/V at every
prompt position plus one state per linear layer; no replica keeps a state slot afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_arch_hybrid import hf_model  # noqa: E402
from test_arch_logits import _char_tokenizer  # noqa: E402
from test_pd import Replica, _complete, _no_blocks_in_use  # noqa: E402

from twinfer.app.pd import start_pd_proxy  # noqa: E402

PROMPTS = ["a prompt of some forty characters, more or less", "short"]


def hybrid_folder(folder: Path) -> str:
    hf_model("next-a").save_pretrained(folder)
    _char_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    model = hybrid_folder(tmp_path_factory.mktemp("qwen3_next"))
    prefill = Replica(model, request.param, "prefill-0")
    decode = Replica(model, request.param, "decode-0")
    proxy = start_pd_proxy([prefill.url], [decode.url])
    try:
        yield {"backend": request.param, "prefill": prefill, "decode": decode, "proxy": proxy}
    finally:
        proxy.stop()
        prefill.close()
        decode.close()


def _state_bytes(runner: Any) -> int:
    """One sequence's conv + delta state over all linear-attention layers, as the runner holds it."""
    states = runner.ops.states
    return sum(states.conv[i][0].nbytes + states.delta[i][0].nbytes for i in states.conv)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_pd_hands_over_kv_and_state_and_keeps_greedy_text(pair: dict[str, Any], prompt: str) -> None:
    prefill, decode, proxy = pair["prefill"], pair["decode"], pair["proxy"]
    single = _complete(prefill.url, prompt)  # the prefill replica, asked plainly, is a single server
    pd = _complete(proxy.url, prompt)
    assert pd["choices"][0]["text"] == single["choices"][0]["text"]
    assert pd["usage"]["completion_tokens"] == single["usage"]["completion_tokens"] == 8
    cost, n = pd["usage"]["cost"], pd["usage"]["prompt_tokens"]
    assert "kv_fallback" not in cost["route"], cost["route"]
    assert cost["tokens"]["cached"]["remote"] == n and cost["tokens"]["computed"] == 0  # nothing recomputed
    state = _state_bytes(decode.runner)
    print(f"{pair['backend']}: {n} prompt tokens, {cost['bytes']['kv_transferred']} bytes handed over "
          f"({n} x {decode.runner.traffic.kv_bytes_per_token:.0f} of K/V + {state} of state)")
    assert cost["bytes"]["kv_transferred"] == n * decode.runner.traffic.kv_bytes_per_token + state
    for replica in (prefill, decode):
        assert replica.runner.ops.states.slots.held == 0, f"{replica.engine.config.replica} keeps a state slot"
    _no_blocks_in_use(prefill, decode)


def test_a_prefill_run_past_its_prompt_sends_no_state(pair: dict[str, Any]) -> None:
    """A request asking to hand over after generating more than one token: its state is past the prompt,
    so nothing is stored (the decoder would recompute) and the prefill replica keeps serving."""
    prefill = pair["prefill"]
    out = _complete(prefill.url, PROMPTS[0], max_tokens=3, kv_transfer_params={"do_remote_decode": True})
    assert out["usage"]["completion_tokens"] == 3 and not out.get("kv_transfer_params")
    assert "save failed" in out["usage"]["cost"]["route"].get("kv_fallback", "")
    assert len(prefill.connector.store) == 0
    assert _complete(prefill.url, PROMPTS[1])["usage"]["completion_tokens"] == 8
