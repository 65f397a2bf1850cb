"""llama.cpp's AMX kernels: the once-per-build verdict, its cache, and the filter that keeps them out."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile

import pytest

from twinfer.backends.llamacpp import amx

linux_x86 = pytest.mark.skipif(not (platform.system() == "Linux" and platform.machine() == "x86_64"),
                               reason="AMX and the seccomp filter are Linux x86_64 only")


@pytest.fixture
def amx_cpu(monkeypatch, tmp_path):
    """A CPU that advertises AMX, a fresh verdict cache, no override."""
    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    monkeypatch.delenv(amx.ENV, raising=False)
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(amx, "_library_key", lambda: "libggml-cpu.so:1:2")
    monkeypatch.setattr(amx, "cpu_model", lambda: "Some Xeon")
    return tmp_path


def test_a_crashing_probe_turns_amx_off_once_and_the_verdict_is_cached(amx_cpu):
    calls = []
    assert amx.amx_verdict(lambda: calls.append(1) or "crash") == "off"
    cached = json.loads((amx_cpu / "hardware" / "llamacpp-amx.json").read_text())
    assert cached == {"libggml-cpu.so:1:2|Some Xeon": "crash"}

    def must_not_run() -> str:
        raise AssertionError("the verdict is cached: no second probe")

    assert amx.amx_verdict(must_not_run) == "off"
    assert calls == [1]


def test_a_new_library_build_is_probed_again(amx_cpu, monkeypatch):
    assert amx.amx_verdict(lambda: "crash") == "off"
    monkeypatch.setattr(amx, "_library_key", lambda: "libggml-cpu.so:1:3")  # rebuilt: size or mtime moved
    assert amx.amx_verdict(lambda: "ok") == "on"


def test_an_inconclusive_probe_changes_nothing_and_is_not_cached(amx_cpu):
    assert amx.amx_verdict(lambda: "unknown") == "on"
    assert not (amx_cpu / "hardware" / "llamacpp-amx.json").exists()


def test_no_amx_on_the_cpu_means_no_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    monkeypatch.delenv(amx.ENV, raising=False)
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: False)
    assert amx.amx_verdict(lambda: pytest.fail("no AMX: nothing to probe")) == "on"


@pytest.mark.parametrize("value", ["on", "off", "OFF "])
def test_the_environment_overrides_the_probe(amx_cpu, monkeypatch, value):
    monkeypatch.setenv(amx.ENV, value)
    assert amx.amx_verdict(lambda: pytest.fail("overridden: no probe")) == value.strip().lower()


@pytest.mark.parametrize(("code", "verdict"), [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crash"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGILL)", "crash"),
    ("pass", "ok"),
    ("raise SystemExit(2)", "unknown"),  # the probe itself failed (no model): not a verdict on the kernels
])
def test_the_probe_reads_a_death_by_signal_as_a_crash(code, verdict):
    assert amx.probe_child(command=[sys.executable, "-c", code]) == verdict


def test_a_probe_killed_mid_write_leaves_no_folder(tmp_path, monkeypatch):
    """The child is killed by the kernels it probes: the scratch folder it wrote into must still go (one was
    left in the temporary folder per crash)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import os, signal, sys; open(os.path.join(sys.argv[1], 'probe.gguf'), 'wb').write(b'GGUF'); "
            "os.kill(os.getpid(), signal.SIGSEGV)")
    assert amx.probe_child(command=[sys.executable, "-c", code]) == "crash"
    assert list(tmp_path.iterdir()) == []


def test_the_filter_program_denies_only_the_amx_request():
    prog = amx.filter_program()
    # every jump lands inside the program, and the two outcomes are EPERM and allow
    for i, (code, jt, jf, _) in enumerate(prog):
        if code == 0x15:
            assert i + 1 + max(jt, jf) < len(prog)
    rets = [k for code, _, _, k in prog if code == 0x06]
    assert rets == [0x00050000 | 1, 0x7FFF0000]


@linux_x86
def test_under_the_filter_the_amx_request_fails_with_eperm_and_other_calls_run():
    child = r"""
import ctypes, os
from twinfer.backends.llamacpp import amx
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def req():
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18))
    return rc, ctypes.get_errno()
assert amx.deny_amx()  # (the parent may already run under it: filters are inherited)
after = req()
supp = ctypes.c_ulong(0)
other = libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1021), ctypes.byref(supp))  # ARCH_GET_XCOMP_SUPP
print(after == (-1, 1), other == 0, os.getpid() > 0, amx.amx_request_allowed())
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "False"]


@linux_x86
def test_deny_wraps_a_command_and_its_children():
    out = subprocess.run([sys.executable, "-m", "twinfer.backends.llamacpp.amx", "--deny", "--", sys.executable, "-c",
                          "from twinfer.backends.llamacpp import amx; print(amx.amx_request_allowed())"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@linux_x86
def test_deny_reads_only_its_own_arguments():
    """`--probe` after `--` belongs to the command: the wrapper must exec it under the filter, not run the
    probe itself, unfiltered (it did, and crashed, where the AMX kernels crash)."""
    inner = "from twinfer.backends.llamacpp import amx; print('inner', amx.amx_request_allowed())"
    out = subprocess.run([sys.executable, "-m", "twinfer.backends.llamacpp.amx", "--deny", "--", sys.executable, "-c",
                          inner, "--probe"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["inner", "False"]


@linux_x86
def test_the_probe_model_decodes_under_the_filter(tmp_path):
    out = subprocess.run([sys.executable, "-m", "twinfer.backends.llamacpp.amx", "--deny", "--", sys.executable, "-m",
                          "twinfer.backends.llamacpp.amx", "--probe", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "twinfer-amx-probe: decoded" in out.stdout


def test_the_module_names_its_usage_on_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "twinfer.backends.llamacpp.amx", "--deny"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "usage:" in out.stderr and "Traceback" not in out.stderr
