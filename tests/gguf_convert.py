"""llama.cpp's own converter (`convert_hf_to_gguf.py`) for tests, obtained the way CI can, and the tiny
tokenizers it needs.

`converter()` pip-downloads the sdist of the installed llama-cpp-python (no wheels, no other
network), extracts `vendor/llama.cpp/convert_hf_to_gguf.py`, its `conversion/` package and
`gguf-py` into a cache folder keyed by the version, and returns it; later calls (and later test
runs: the folder lives in a shared cache, see `_cache_root`) reuse it. `convert(folder, out)` runs
the converter in a subprocess with that `gguf-py` first on PYTHONPATH.

`save_tiny_tokenizer(folder, family)` writes a byte-level BPE tokenizer (trained here on a few lines
of text, no download) with the special tokens and the chat template a `family`'s converter and
llama.cpp expect. The converter identifies a BPE pre-tokenizer by hashing the tokens of a probe
text, which only published tokenizers match; a tiny tokenizer uses GPT-2's pre-tokenizer regex, so
the conversion declares it `gpt-2` (`PRE_TOKENIZER`), which llama.cpp and twinfer both run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import cache
from pathlib import Path

import pytest

PRE_TOKENIZER = "gpt-2"
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _cache_root() -> Path:
    """A cache shared between test runs (the converter of one pinned version never changes);
    $TWINFER_TEST_SHARED_CACHE, else a folder under the system temp dir."""
    given = os.environ.get("TWINFER_TEST_SHARED_CACHE")
    return Path(given) if given else Path(tempfile.gettempdir()) / "twinfer-test-shared"


@cache
def converter() -> Path:
    """The folder holding llama.cpp's `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` of the
    installed llama-cpp-python; skips the test when the package registry cannot be reached."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llama-cpp-python is not installed")
    root = _cache_root() / f"llama.cpp-{version}"
    if (root / "convert_hf_to_gguf.py").is_file() and (root / "gguf-py" / "gguf").is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", tmp],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        sdists = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if download.returncode != 0 or not sdists:
            pytest.skip(f"cannot download the llama-cpp-python {version} sdist: {download.stderr.strip()[-300:]}")
        staged = Path(tmp) / "out"
        prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                rel = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and rel.startswith(_MEMBERS) and (member.isfile() or member.isdir()):
                    member.name = rel
                    tar.extract(member, staged, filter="data")
        if not (staged / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{sdists[0].name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        if root.exists():  # another process finished first
            return root
        shutil.move(str(staged), root)
    return root


# Runs the converter's main once per (folder, out) pair in one interpreter (torch and transformers are
# imported once), with the pre-tokenizer check told what the tiny tokenizer is.
_DRIVER = """
import json, runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
for folder, out, outtype, extra in json.loads(sys.argv[1]):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype, *extra]
    runpy.run_path({script!r}, run_name="__main__")
"""


def convert(folder: Path, out: Path, outtype: str = "f32", args: tuple[str, ...] = ()) -> Path:
    """Convert the Hugging Face folder `folder` to the GGUF file `out` (`outtype` f32 / f16 / bf16 / q8_0);
    `args`: more converter options (`--no-mtp`)."""
    convert_many([(folder, out)], outtype, args)
    return out


def convert_many(pairs: list[tuple[Path, Path]], outtype: str = "f32", args: tuple[str, ...] = ()) -> None:
    """Convert each (Hugging Face folder, GGUF file) pair in one converter process."""
    root = converter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), str(root)]), NO_LOCAL_GGUF="1")
    driver = _DRIVER.format(pre=PRE_TOKENIZER, script=str(root / "convert_hf_to_gguf.py"))
    jobs = json.dumps([(str(folder), str(out), outtype, list(args)) for folder, out in pairs])
    result = subprocess.run([sys.executable, "-c", driver, jobs], capture_output=True, text=True, env=env, cwd=root,
                            timeout=900)
    missing = [str(folder) for folder, out in pairs if not out.is_file()]
    if result.returncode != 0 or missing:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {missing}:\n{result.stderr[-3000:]}")


# -- tiny tokenizers --------------------------------------------------------------------------------
# Each family: special tokens (the converter reads some by name), the eos token, and a chat template
# in the family's format, small enough to read.
FAMILIES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "deepseek": (
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        "<｜end▁of▁sentence｜>",
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
        "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
        "{% else %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}",
    ),
    "glm": (
        ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
         "<|assistant|>", "<|observation|>"),
        "<|endoftext|>",
        "[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ),
    "gpt_oss": (
        ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
         "<|end|>", "<|message|>", "<|call|>"),
        "<|return|>",
        "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant<|channel|>final<|message|>' }}{% endif %}",
    ),
}
TINY_VOCAB = 320  # 256 byte tokens, a few dozen merges, the special tokens

_TEXT = (
    "The quick brown fox jumps over the lazy dog. def main(): return 0\n"
    "A model reads tokens and writes the next one; the engine schedules, samples and streams them.\n"
    "for i in range(10): print(i)  # numbers 0 1 2 3 4 5 6 7 8 9\n"
)


def save_tiny_tokenizer(folder: Path, family: str, vocab_size: int = TINY_VOCAB) -> None:
    """Write tokenizer.json and tokenizer_config.json for `family` into `folder`; ids < `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, eos, template = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([_TEXT] * 4, trainer)
    tok.add_special_tokens(list(specials))
    assert tok.get_vocab_size() <= vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=specials[0])
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template  # transformers 5 writes it to chat_template.jinja; the converter reads either
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
