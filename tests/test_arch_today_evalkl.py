"""`twinfer eval kl` against transformers for every architecture added with the recurrent hybrids.

One tiny random folder per architecture (the builders of test_arch_today_moe.py, test_arch_gemma4.py,
test_arch_dsa.py and test_arch_hybrid.py) with a character tokenizer; the command runs in-process
through the CLI's own parser with `--candidate torch` and `--candidate mlx`, and each must score a
mean KL(transformers || twinfer) <= 1e-5 with every top-1 token agreeing. The reference is
transformers in fp32, as a user runs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

import test_arch_dsa as dsa  # noqa: E402
import test_arch_gemma4 as gemma4  # noqa: E402
import test_arch_hybrid as hybrid  # noqa: E402
import test_arch_today_moe as today  # noqa: E402
from test_arch_logits import _char_tokenizer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from twinfer.cli.main import app  # noqa: E402

TOKENS, WINDOW = 48, 48  # one window of 47 scored rows per candidate

# architecture -> how its folder is written (a random model saved as fp32 safetensors)
FOLDERS: dict[str, Callable[[Path], Any]] = {
    "minimax_m2": lambda p: today.minimax_model("minimax_m2-a").save_pretrained(p),
    "kimi_k25": lambda p: today.save_kimi_published(today.kimi_model("kimi_k25-a"), p),
    "gemma4": lambda p: gemma4.hf_model("all").save_pretrained(p),
    "deepseek_v32": lambda p: dsa.hf_model("deepseek_v32-a").save_pretrained(p),
    "glm_moe_dsa": lambda p: dsa.hf_model("glm_moe_dsa-a").save_pretrained(p),
    "qwen3_next": lambda p: hybrid.hf_model("next-a").save_pretrained(p),
    "qwen3_5_moe": lambda p: hybrid.hf_model("q35-a").save_pretrained(p),
}
SLOW = ("minimax_m2", "gemma4")  # ~7 s each on 2 cores: the default run keeps the other five (~20 s)


def eval_kl(folder: Path, candidate: str) -> dict[str, Any]:
    """`twinfer eval kl FOLDER --reference transformers --candidate CANDIDATE --json`, parsed."""
    args = ["eval", "kl", str(folder), "--reference", "transformers", "--candidate", candidate,
            "--tokens", str(TOKENS), "--window", str(WINDOW), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output[-2000:], result.exception)
    line = result.output[result.output.index('{"reference"'):].splitlines()[0]  # after stderr's progress bars
    report: dict[str, Any] = json.loads(line)
    return report


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in SLOW else a for a in FOLDERS])
def test_eval_kl_torch_and_mlx_against_transformers(arch: str, tmp_path: Path) -> None:
    folder = tmp_path / arch
    FOLDERS[arch](folder)
    _char_tokenizer(folder)
    for candidate in ("torch", "mlx"):
        report = eval_kl(folder, candidate)
        print(f"{arch} {candidate}: mean KL {report['mean_kl']:.2e} over {report['tokens']} tokens, "
              f"top-1 {report['top1_agreement']:.3f}")
        assert report["tokens"] == TOKENS - 1 and report["candidate"] == candidate
        assert report["mean_kl"] <= 1e-5 and report["top1_agreement"] == 1.0
