"""`--hardware` as a description: inline key=value pairs, a TOML file, a JSON file, and the messages for bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from twinfer.planners.describe import describe_device, parse_inline, resolve_cluster
from twinfer.planners.hardware import GPU
from twinfer.runtime.errors import PlanError

INLINE = "gpu:memory=24GB,bandwidth=1008GB/s,bf16=165TFLOPS,link=pcie4"

TOML = """
kind = "gpu"
label = "My RTX 4090"
memory_gb = 24
bandwidth_gbs = 1008
vector_tflops = 82.6
clock_ghz = 2.52
link = "pcie4"
memory_type = "gddr"
max_per_node = 4

[tensor_tflops]
bf16 = 165.2
fp8 = 330.3
int8 = 660.6
"""


def test_inline_description_with_units_and_stated_defaults() -> None:
    cluster = resolve_cluster(INLINE)
    d = cluster.device
    assert (d.kind, d.memory_gb, d.bandwidth_gbs, dict(d.tensor_tflops)) == (GPU, 24.0, 1008.0, {"bf16": 165.0})
    assert (d.link, d.interconnect_gbs, d.host_link_gbs, d.max_per_node) == ("pcie4", 64.0, 64.0, 8)
    assert d.vector_tflops == pytest.approx(165 / 4) and d.clock_ghz == 1.8
    for assumption in ("FP32 rate assumed a quarter", "memory assumed GDDR", "clock assumed 1.8 GHz"):
        assert assumption in d.source
    assert "link assumed" not in d.source  # it was given
    assert cluster.capacity_per_device == pytest.approx(24e9 * 0.92)


@pytest.mark.parametrize("text,key,value", [
    ("memory=16GiB", "memory_gb", 16 * 1.073741824), ("memory=1.5TB", "memory_gb", 1500.0),
    ("bandwidth=1.8TB/s", "bandwidth_gbs", 1800.0), ("bandwidth=500MB/s", "bandwidth_gbs", 0.5),
    ("fp4=1PFLOPS", "fp4", 1000.0), ("int8=130TOPS", "int8", 130.0), ("vector=500GFLOPS", "vector_tflops", 0.5),
    ("clock=2520MHz", "clock_ghz", 2.52), ("clock=2.52", "clock_ghz", 2.52), ("bw=936", "bandwidth_gbs", 936.0),
    ("interconnect=900GB/s", "interconnect_gbs", 900.0), ("per_node=2", "max_per_node", "2"),
])
def test_inline_units(text: str, key: str, value: float | str) -> None:
    got = parse_inline(text)[key]
    assert got == (pytest.approx(value) if isinstance(value, float) else value)


def test_toml_file(tmp_path: Path) -> None:
    if sys.version_info < (3, 11):
        pytest.importorskip("tomli")
    path = tmp_path / "my-card.toml"
    path.write_text(TOML)
    cluster = resolve_cluster(str(path), gpus=2)
    d = cluster.device
    assert (d.label, d.memory_gb, d.vector_tflops, d.clock_ghz, d.max_per_node) == ("My RTX 4090", 24, 82.6, 2.52, 4)
    assert dict(d.tensor_tflops) == {"bf16": 165.2, "fp8": 330.3, "int8": 660.6}
    assert cluster.gpus_per_node == 2 and str(path) in d.source and "assumed" not in d.source


def test_json_file_with_unit_strings_and_a_budget(tmp_path: Path) -> None:
    path = tmp_path / "mac.json"
    path.write_text(json.dumps({"kind": "apple", "memory": "64GB", "bandwidth": "400GB/s", "vector": 13.6,
                                "storage_gbs": 5}))
    cluster = resolve_cluster(str(path), memory_budget="20GB")
    d = cluster.device
    assert (d.kind, d.memory_type, d.memory_gb, d.storage_gbs, d.link) == ("apple", "lpddr", 64.0, 5.0, "none")
    assert dict(d.tensor_tflops) == {"f16": 13.6, "bf16": 13.6} and cluster.capacity_per_device == 20e9


def test_cpu_description_plans_on_the_local_target() -> None:
    from twinfer.planners import catalog
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request

    cluster = resolve_cluster("cpu:memory=16GB,bandwidth=60GB/s,vector=1.2TFLOPS,int8=4.8TOPS")
    assert dict(cluster.device.tensor_tflops) == {"int8": 4.8, "f32": 1.2}
    plan = make_plan(catalog.find("qwen3-1.7b").profile(), cluster, Request(4096, 1))
    assert plan.fits and plan.target == "local" and plan.to_json()["hardware"]["name"] == "described"


def test_plan_and_hw_commands_take_a_description(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from twinfer.cli.hw_cmd import run_hw
    from twinfer.cli.plan_cmd import PlanOptions, run_plan

    run_plan(PlanOptions("llama-3.1-8b", INLINE, context=4096, json_out=True))
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["hardware"]["bandwidth_gbs"] == 1008 and plan["target"] == "local"
    path = tmp_path / "card.json"
    path.write_text(json.dumps({"memory_gb": 48, "bandwidth_gbs": 864, "bf16": 366, "memory_type": "gddr"}))
    run_hw(False, True, False, str(path))
    row = json.loads(capsys.readouterr().out)
    assert row["memory_gb"] == 48 and row["tensor_tflops"] == {"bf16": 366} and "kind assumed gpu" in row["source"]


def test_a_described_cpu_says_what_llama_cpp_kernels_get(tmp_path: Path) -> None:
    """`cores`, `repacks` and `huge_pages` give a described CPU the kernel-streaming bound and the huge-page
    factor a probed one gets: with 2 cores the plan is slower than the memory alone allows, and faster on
    huge pages; without `cores` the source says no bound applies."""
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import resolve

    base = "cpu:memory=24GB,bandwidth=60GB/s,vector=0.2TFLOPS,int8=0.8TOPS,clock=3.1GHz"
    bare = resolve_cluster(base)
    assert bare.device.cores == 0 and "no bound from llama.cpp's kernels" in bare.device.source
    cores = resolve_cluster(base + ",cores=2,repacks=q4_0/q4_k")
    huge = resolve_cluster(base + ",cores=2,repacks=q4_0/q4_k,huge_pages=yes")
    assert cores.device.cores == 2 and cores.device.repacks == ("q4_0", "q4_k") and huge.device.huge_pages
    path = tmp_path / "cpu.toml"
    path.write_text('kind = "cpu"\nmemory_gb = 24\nbandwidth_gbs = 60\nvector_tflops = 0.2\nclock_ghz = 3.1\n'
                    'cores = 2\nrepacks = ["q4_0", "q4_k"]\nhuge_pages = true\n[tensor_tflops]\nint8 = 0.8\n')
    if sys.version_info >= (3, 11):  # tomllib
        from_file = resolve_cluster(str(path)).device
        assert (from_file.cores, from_file.repacks, from_file.huge_pages) == (2, ("q4_0", "q4_k"), True)

    def decode(cluster):
        return make_plan(resolve(None), cluster, Request(64, 1)).to_json()["predicted"]["decode_tokens_per_s"]

    assert decode(cores) < decode(bare) * 0.9  # the kernels, not 60 GB/s, set the pace on 2 cores
    assert decode(huge) > decode(cores) * 1.05


@pytest.mark.parametrize("text,message", [
    ("cpu:memory=24GB,bandwidth=60GB/s,vector=1,cores=two", "cores: cannot read 'two'; write e.g. cores=8"),
    ("cpu:memory=24GB,bandwidth=60GB/s,vector=1,huge_pages=maybe", "huge_pages: cannot read 'maybe'"),
    ("cpu:memory=24GB,bandwidth=60GB/s,vector=1,repacks=q4_0/q9_z", "repacks: q9_z is not a weight format"),
    ("gpu:memory=24GB,bandwidth=1008GB/s,bf16=165,cores=8", "cores describe a CPU's llama.cpp kernels"),
    ("gpu:bandwidth=1008GB/s,bf16=165", "memory_gb is missing; write e.g. memory=24GB"),
    ("gpu:memory=24GB,bf16=165", "bandwidth_gbs is missing; write e.g. bandwidth=1008GB/s"),
    ("gpu:memory=24GB,bandwidth=fast,bf16=165", "bandwidth_gbs: cannot read 'fast'; write e.g. bandwidth=1008GB/s"),
    ("gpu:memory=24 parsecs,bandwidth=1,bf16=1", "memory_gb: cannot read '24 parsecs'"),
    ("gpu:memory=24GB,bandwidth=1008GB/s,colour=red", "unknown key 'colour'"),
    ("tpu:memory=24GB,bandwidth=1008GB/s,bf16=165", "kind must be gpu, cpu or apple, not 'tpu'"),
    ("gpu:memory=24GB,bandwidth=1008GB/s", "give the GPU's dense tensor rate (bf16=165TFLOPS"),
    ("cpu:memory=24GB,bandwidth=60GB/s", "give the cpu's FP32 rate, vector="),
    ("gpu:memory=24GB,bandwidth=1008GB/s,bf16=165,link=pigeon", "unknown link 'pigeon'"),
    ("gpu:memory=0GB,bandwidth=1008GB/s,bf16=165", "memory_gb must be a positive number"),
    ("gpu:memory=24GB,bandwidth=1008GB/s,bf16=0", "bf16 must be a positive number, got '0'; write e.g. bf16=165TFLOPS"),
    ("gpu:memory=24GB,bandwidth=1008GB/s,bf16=165,memory_type=sram", "memory_type must be one of hbm"),
    ("gpu:memory=24GB,bandwidth=1008GB/s,bf16=165,per_node=two", "max_per_node must be a whole number"),
    ("gpu:memory,bandwidth=1008GB/s", "write key=value pairs separated by commas"),
])
def test_bad_inline_descriptions_say_which_field_and_what_to_write(text: str, message: str) -> None:
    with pytest.raises(PlanError) as e:
        resolve_cluster(text)
    assert message in str(e.value)


def test_described_gpus_without_a_link_refuse_several() -> None:
    with pytest.raises(PlanError, match="names no link between its GPUs"):
        resolve_cluster("gpu:memory=24GB,bandwidth=1008GB/s,bf16=165,link=none", gpus=2)
    assert resolve_cluster("gpu:memory=24GB,bandwidth=1008GB/s,bf16=165,link=nvlink4", gpus=8).world == 8


@pytest.mark.parametrize("name,content,message", [
    ("missing.toml", None, "cannot read the file"),
    ("broken.toml", "memory_gb = = 3", "not valid TOML"),
    ("broken.json", "{memory_gb: 3", "not valid JSON"),
    ("list.json", "[1, 2]", "expected a table of keys"),
    ("dtype.json", '{"memory_gb": 8, "bandwidth_gbs": 100, "tensor_tflops": {"tf32": 8}}', "tensor_tflops.tf32 is not"),
    ("flag.json", '{"memory_gb": true, "bandwidth_gbs": 100, "bf16": 8}', "memory_gb: True is not a number"),
])
def test_bad_files_say_what_is_wrong(tmp_path: Path, name: str, content: str | None, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlanError) as e:
        resolve_cluster(str(path))
    assert message in str(e.value) and name in str(e.value)


def test_table_names_still_resolve_and_describe_device_defaults_to_a_gpu() -> None:
    assert resolve_cluster("hgx-h100").world == 8
    assert resolve_cluster("rtx4090", gpus=2).device.name == "rtx-4090"
    d = describe_device({"memory_gb": 8.0, "bandwidth_gbs": 100.0, "vector_tflops": 5.0})
    assert d.kind == GPU and dict(d.tensor_tflops) == {"bf16": 20.0, "f16": 20.0} and "kind assumed gpu" in d.source
