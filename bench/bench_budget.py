"""The local target's headline: an MoE twice the memory budget, at batch 1, on a GGUF, beside llama-bench.

    python bench/bench_budget.py --dir /tmp/budget [--llama-bin DIR] [--rounds 3] [--routing uniform] > out.json

Builds (once, in --dir) the `--shape` models with llama.cpp's own converter (tests/moe_gguf.py): `qwen3`, a
random Qwen3-MoE in BF16 (16 layers, 64 experts top-4, 1.66 GB); `gpt-oss`, gpt-oss-20b's layer shape (4
layers, 32 experts top-4 of FFN 2880, sinks, sliding and full attention alternating) with MXFP4 experts,
1.81 GB; and llama-bench from the installed llama-cpp-python's sdist
(`cmake -B build -DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-bench`), unless --llama-bin
names a built one. Then, each round, under a memory limit of budget + 600 MB (a cgroup: v2 through
`systemd-run --scope -p MemoryMax=`, else a v1 child of this process's memory cgroup) with the model's
pages dropped from the page cache first (`/proc/sys/vm/drop_caches` where permitted, else
`posix_fadvise(DONTNEED)` on the file, which any reader may do):

- `twinfer bench MODEL -c 1 --memory-budget HALF --json` (half the file's bytes; the first run also makes
  the requantized file when the budget chooses one, and is not timed);
- `llama-bench -m MODEL -p 0 -n 128 -r 2` at its defaults, and with `--repack 0` (its default repacking
  copies the tensors it repacks out of the mapping into anonymous memory; without it the file stays mapped
  and the kernel pages it under the same limit).

Prints one JSON object per shape: each run's decode tok/s, the cgroup's peak usage (page cache included),
OOM kills and whether it was killed after thrashing 5 minutes, the process's own peak RSS (`wait4`) and the
interpreter's baseline, the plan's predicted bytes and its KL (expected and measured), the budget's summary,
the load average, and the host, kernel and builds; and, untimed, the routing
(per-layer usage entropy against log(experts)) and the expert pager's hit rate with the budget less the dense
weights as its bound, over 128 decode steps of a text favouring no token and of prose. `--routing uniform`
runs the shapes with routers that spread top-k evenly (tests/moe_gguf.py `uniform_routing`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HEADROOM = 600 * 10**6  # the limit over the budget: interpreter, libraries and page cache for the rest


def build_llama_bench(work: Path) -> Path:
    """llama-bench built from the installed llama-cpp-python's sdist (its vendored llama.cpp); its bin dir."""
    version = importlib.metadata.version("llama-cpp-python")
    src = work / f"llama.cpp-{version}"
    bin_dir = src / "build" / "bin"
    if (bin_dir / "llama-bench").is_file():
        return bin_dir
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True, capture_output=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name.removeprefix(prefix)
            tar.extractall(src, members=[m for m in members if m.name], filter="data")
    subprocess.run(["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"], cwd=src, check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", "build", "-j2", "--target", "llama-bench"], cwd=src, check=True,
                   capture_output=True)
    return bin_dir


def drop_cache(model: Path) -> str:
    """Drop the model's pages from the page cache; how it was done."""
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(model, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "posix_fadvise(DONTNEED)"


def _v1_parent() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


@contextlib.contextmanager
def limited(limit: int) -> Iterator[tuple[list[str], Path | None]]:
    """(a command prefix, a v1 cgroup folder or None) that run a command under `limit` bytes of memory."""
    if shutil.which("systemd-run") and Path("/sys/fs/cgroup/cgroup.controllers").exists():
        yield ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={limit}", "-p", "MemorySwapMax=0"], None
        return
    parent = _v1_parent()
    if parent is None or not parent.is_dir():
        raise SystemExit("bench_budget: no writable memory cgroup (v2 with systemd-run, or v1) on this host")
    group = parent / f"twinfer-bench-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):  # no swap accounting: the limit is on memory alone
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
        yield [], group
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


RUN_TIMEOUT_S = 300  # a run that thrashes under the limit this long is killed and reported as timed out


def run_limited(cmd: list[str], limit: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` under `limit`; its exit code, stdout, the cgroup's peak and OOM kills (v1), and whether it
    ran past `RUN_TIMEOUT_S` (killed: a process whose pages the limit keeps evicting can thrash for hours
    without an OOM kill)."""
    with limited(limit) as (prefix, group):
        def enter() -> None:
            if group is not None:
                (group / "cgroup.procs").write_text(str(os.getpid()))

        with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
            proc = subprocess.Popen([*prefix, *cmd], stdout=so, stderr=se, text=True,
                                    env={**os.environ, **(env or {})}, preexec_fn=enter)
            killer = threading.Timer(RUN_TIMEOUT_S, proc.kill)
            killer.start()
            _, status, usage = os.wait4(proc.pid, 0)
            timed_out = not killer.is_alive()
            killer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
            so.seek(0), se.seek(0)
            out: dict[str, Any] = {"rc": proc.returncode, "stdout": so.read(), "stderr": se.read()[-2000:],
                                   "rss_peak_bytes": usage.ru_maxrss * 1024, "load_average": os.getloadavg(),
                                   "timed_out": timed_out}
        if group is not None:
            out["peak_bytes"] = int((group / "memory.max_usage_in_bytes").read_text())
            oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
        return out


def twinfer_run(model: Path, budget: int, limit: int, cache: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "twinfer.cli.main", "bench", str(model), "-c", "1", "--memory-budget", str(budget),
           "--json"]
    r = run_limited(cmd, limit, {"TWINFER_CACHE": str(cache)})
    if r["rc"] == 0:
        report = json.loads(r["stdout"])
        row = report["results"][0]
        r.update(decode_tok_s=1.0 / row["tpot_p50_s"], output_tok_s=row["output_tokens_per_s"],
                 summary=report.get("memory_budget"), kl=report.get("memory_budget_kl"),
                 predicted_bytes=report.get("memory_budget_predicted_bytes"), build=report.get("build"))
    r.pop("stdout")
    return r


def llama_bench_run(bin_dir: Path, model: Path, limit: int, *extra: str) -> dict[str, Any]:
    from bench_peers import llama_bench_cmd

    r = run_limited([*llama_bench_cmd(bin_dir, model), "-r", "2", *extra], limit)  # paging: two repetitions
    if r["rc"] == 0:
        r["decode_tok_s"] = float(json.loads(r["stdout"])[0]["avg_ts"])
    r.pop("stdout")
    return r


# the peer at its defaults, and as a user who knows the limit runs it: repacked weights are anonymous copies
PEERS: dict[str, tuple[str, ...]] = {"llama_bench": (), "llama_bench_repack0": ("--repack", "0")}
SIDES = ["twinfer", *PEERS]

SHAPES = {"qwen3": "qwen3_moe 16 layers, 64 experts top-4, BF16",
          "gpt-oss": "gpt_oss 4 layers (gpt-oss-20b's), 32 experts top-4, MXFP4 experts, Q8_0 rest"}


def build_model(folder: Path, shape: str, routing: str = "random") -> Path:
    from tests.moe_gguf import write_gpt_oss_gguf, write_qwen3_moe_gguf

    if shape == "qwen3":
        return write_qwen3_moe_gguf(folder, "1.6gb", routing=routing)
    return write_gpt_oss_gguf(folder, "20b-4l", routing=routing)


def routing_report(model: Path, budget: int) -> dict[str, Any]:
    """Usage entropy and the pager's hit rate (bound: the budget less the dense weights), 128 decode steps."""
    from twinfer.backends.llamacpp.paging import is_expert
    from twinfer.backends.llamacpp.routing import trace, vocabulary_text
    from twinfer.quant.fidelity import corpus_windows
    from twinfer.runtime.loaders.gguf_reader import GGUFContents

    dense = sum(t.nbytes for t in GGUFContents(model).tensors.values() if not is_expert(t.name))
    bound = max(0, budget - dense)
    (prose,) = corpus_windows(str(model), "prose", 129, 130)
    texts = {"vocabulary": vocabulary_text(model, 129, seed=0), "prose": prose[-129:]}
    return {"bound_bytes": bound} | {name: trace(model, t[:1], t[1:], bound=bound)[1].summary() for name, t in texts.items()}


# what a `twinfer bench` process holds before it opens a model: the peak-against-plan comparison's zero
BASELINE = """
import twinfer.app.bench, twinfer.cli.bench_cmd, twinfer.cli.main
from twinfer.backends.llamacpp._lib import load_llama_cpp
from twinfer.runtime.tokenizer import load_tokenizer
load_llama_cpp(), load_tokenizer({model!r})
"""


def bench_shape(model: Path, shape: str, bin_dir: Path, rounds: int, cache: Path, routing: str) -> dict[str, Any]:
    """Warm-up, then `rounds` interleaved pairs of twinfer and llama-bench under one limit, for one model."""
    from twinfer.app.bench import hardware_info

    size = model.stat().st_size
    budget = size // 2
    limit = budget + HEADROOM
    drop_cache(model)
    baseline = run_limited([sys.executable, "-c", BASELINE.format(model=str(model))], limit)["rss_peak_bytes"]
    warm = twinfer_run(model, budget, limit, cache)  # makes the requantized file if the budget asks for one
    out = []
    for i in range(rounds):
        row: dict[str, Any] = {}
        for side in SIDES[i % len(SIDES):] + SIDES[: i % len(SIDES)]:
            row["dropped_by"] = drop_cache(model)
            row[side] = (twinfer_run(model, budget, limit, cache) if side == "twinfer"
                         else llama_bench_run(bin_dir, model, limit, *PEERS[side]))
        out.append(row)
    med = {side: statistics.median(r[side].get("decode_tok_s", 0.0) for r in out) for side in SIDES}
    return {
        "model": {"path": str(model), "bytes": size, "shape": SHAPES[shape], "routing": routing},
        "budget_bytes": budget, "limit_bytes": limit, "baseline_rss_bytes": baseline, "warm_up": warm, "rounds": out,
        # the plan's model bytes against the process's peak less its interpreter, libraries and tokenizer
        "peak_over_predicted": [r["twinfer"]["rss_peak_bytes"] - baseline - r["twinfer"]["predicted_bytes"]
                                for r in out if r["twinfer"].get("predicted_bytes")],
        "routing": routing_report(model, budget),
        "median_decode_tok_s": med,  # 0: every run killed
        "ratio": {peer: med["twinfer"] / med[peer] if med[peer] else None for peer in PEERS},
        "hardware": hardware_info(), "kernel": platform.release(),
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the models, llama-bench and caches go")
    ap.add_argument("--llama-bin", type=Path, help="a built llama.cpp bin dir (default: build one in --dir)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--routing", choices=["random", "uniform"], default="random",
                    help="the random weights' routers, or ones spreading top-k evenly over tokens")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    a.dir.mkdir(parents=True, exist_ok=True)
    bin_dir = a.llama_bin or build_llama_bench(a.dir)
    shapes = list(SHAPES) if a.shape == "all" else [a.shape]
    report = {s: bench_shape(build_model(a.dir, s, a.routing), s, bin_dir, a.rounds, a.dir / "cache", a.routing)
              for s in shapes}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
