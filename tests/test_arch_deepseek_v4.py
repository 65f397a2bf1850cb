"""DeepSeek-V4 is refused, naming each part twinfer lacks, through the loader and the CLI.

A tiny random DeepseekV4ForCausalLM (transformers' own config and weights: hyper-connections, CSA and
HCA layers, hash-routed first layers) saved as a folder; every face that opens it must print one line
that names what is missing, not a traceback or "unsupported model_type".
"""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders import load_model
from twinfer.runtime.models import MODEL_TYPES, NOT_YET, supported_types
from twinfer.runtime.models.deepseek_v4 import MISSING

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

from test_arch_logits import _char_tokenizer  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
            head_dim=32, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=8,
            index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2,
            partial_rotary_factor=0.25, max_position_embeddings=256,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})


@cache
def folder(root: str) -> Path:
    path = Path(root) / "deepseek_v4-tiny"
    config = transformers.DeepseekV4Config(**TINY)
    assert "compressed_sparse_attention" in config.layer_types and "hash_moe" in config.mlp_layer_types
    torch.manual_seed(0)
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(path)
    _char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dsv4"))


def test_loader_refuses_naming_every_missing_part(root: str) -> None:
    with pytest.raises(UnsupportedArchitecture) as info:
        load_model(folder(root))
    message = str(info.value)
    assert "\n" not in message and message.startswith("DeepSeek-V4 (model_type 'deepseek_v4') does not run")
    assert all(part in message for part in MISSING) and len(MISSING) == 4
    # recognised, not supported: never listed among the types twinfer runs
    assert "deepseek_v4" in NOT_YET and "deepseek_v4" not in MODEL_TYPES and "deepseek_v4" not in supported_types()


@pytest.mark.parametrize("args", [
    ("generate", "{model}", "hello"),
    ("eval", "kl", "{model}", "--reference", "transformers", "--candidate", "torch", "--tokens", "32"),
])  # fmt: skip
def test_cli_prints_the_refusal_on_one_line(root: str, args: tuple[str, ...]) -> None:
    argv = [a.format(model=folder(root)) for a in args]
    result = subprocess.run([sys.executable, "-c", "from twinfer.cli.main import main; main()", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("twinfer: error:")]
    assert len(lines) == 1 and "does not run in twinfer yet" in lines[0]
    assert "hyper-connections" in lines[0] and "hash routing" in lines[0]
