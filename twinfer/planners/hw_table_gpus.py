"""The NVIDIA GPUs people own: GeForce RTX 20/30/40/50 (desktop and laptop), RTX and Quadro workstation
cards, and PCIe data-center cards back to the Tesla K80.

Every tensor and FP32 peak here is derived the way NVIDIA's own tables are: SM count x boost clock (the
product page) x dense operations per clock per SM (the architecture whitepaper, `_ARCH`). The test
`test_owned_gpu_rows_reproduce_published_peaks` checks the derivation against the headline numbers
the vendor pages print (halved where they print "with sparsity"). GeForce cards multiply FP16/BF16 and
FP8 at half rate when accumulating in FP32, which is what inference kernels do, so their rows carry
the FP32-accumulate rates; workstation and data-center cards (and the TITAN RTX) run both at full rate. Turing and Volta
have no BF16 and Volta no INT8 tensor cores, so their rows list only what the chip runs natively.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinfer.planners.hardware import GPU, LINK_GBS, Device

# (dense tensor ops per clock per SM by dtype, FP32 lanes per SM, whitepaper)
_ARCH: dict[str, tuple[dict[str, int], int, str]] = {
    # no matrix units and no int8 dot product: every multiply runs on the FP32 lanes
    "kepler": ({"f32": 384}, 192, "NVIDIA Kepler GK110/GK210 architecture whitepaper (192 FP32 lanes per SMX)"),
    "maxwell": ({"f32": 256}, 128, "NVIDIA Maxwell GM200 architecture (128 FP32 lanes per SM)"),
    # Pascal GP102 has no tensor cores; its int8 rate is the DP4A dot product llama.cpp's quantized kernels use
    "pascal": ({"int8": 1024}, 128, "NVIDIA Tesla P40 datasheet (47 TOPS INT8 by DP4A, 12 TFLOPS FP32 at 30 SMs)"),
    "volta": ({"f16": 1024}, 64, "NVIDIA Tesla V100 GPU architecture whitepaper"),
    "turing": ({"f16": 1024, "int8": 2048}, 64, "NVIDIA Turing GPU architecture whitepaper (Tesla T4)"),
    "turing-geforce": ({"f16": 512, "int8": 2048}, 64,
                       "NVIDIA Turing GPU architecture whitepaper (GeForce, FP32 accumulate)"),
    "ga100": ({"bf16": 2048, "f16": 2048, "int8": 4096}, 64, "NVIDIA A100 Tensor Core GPU architecture whitepaper"),
    "ampere": ({"bf16": 1024, "f16": 1024, "int8": 2048}, 128,
               "NVIDIA Ampere GA102 GPU architecture whitepaper (professional rates)"),
    "ampere-geforce": ({"bf16": 512, "f16": 512, "int8": 2048}, 128,
                       "NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce, FP32 accumulate)"),
    "ada": ({"bf16": 1024, "f16": 1024, "fp8": 2048, "int8": 2048}, 128,
            "NVIDIA Ada GPU architecture whitepaper (professional rates)"),
    "ada-l40": ({"bf16": 512, "f16": 512, "fp8": 1024, "int8": 1024}, 128,
                "NVIDIA L40 datasheet (181 dense BF16 TFLOPS at 142 SMs: half the L40S rate)"),
    "ada-geforce": ({"bf16": 512, "f16": 512, "fp8": 1024, "int8": 2048}, 128,
                    "NVIDIA Ada GPU architecture whitepaper (GeForce, FP32 accumulate)"),
    "blackwell-geforce": ({"bf16": 512, "f16": 512, "fp8": 1024, "int8": 2048, "fp4": 4096}, 128,
                          "NVIDIA RTX Blackwell GPU architecture whitepaper (FP32 accumulate; FP4 = AI TOPS / 2)"),
}

_GF20 = "nvidia.com/en-us/geforce/20-series/"
_GF30 = "nvidia.com/en-us/geforce/graphics-cards/30-series/"
_GF40 = "nvidia.com/en-us/geforce/graphics-cards/40-series/"
_GF50 = "nvidia.com/en-us/geforce/graphics-cards/50-series/"
_PRO = "nvidia.com/en-us/design-visualization/"
_DC = "nvidia.com/en-us/data-center/"


@dataclass(frozen=True)
class Card:
    """One NVIDIA card as its spec sheet lists it: architecture (a key of `_ARCH`), SM count, boost clock
    (GHz), memory (GB, GB/s, type, other sizes sold) and host link (`lanes` of PCIe)."""

    arch: str
    sms: int
    boost: float
    mem: float
    bw: float
    link: str = "pcie4"
    lanes: int = 16
    mtype: str = "gddr"
    options: tuple[float, ...] = ()


def nv_row(key: str, label: str, card: Card, source: str, per_node: int = 4, aliases: tuple[str, ...] = ()
           ) -> Device:
    """One NVIDIA card's row, its peaks derived from the SM count and boost clock."""
    c = card
    rates, lanes_fp32, paper = _ARCH[c.arch]
    pcie = LINK_GBS[c.link if c.link.startswith("pcie") else "pcie3"] * c.lanes / 16  # SXM2 hosts on PCIe 3
    tensor = tuple((k, round(c.sms * c.boost * r / 1000, 1)) for k, r in rates.items())
    return Device(
        name=key, label=label, vendor="nvidia", kind=GPU, memory_gb=c.mem, bandwidth_gbs=c.bw, memory_type=c.mtype,
        interconnect_gbs=LINK_GBS[c.link] * c.lanes / 16, link=c.link, tensor_tflops=tensor,
        vector_tflops=round(c.sms * lanes_fp32 * 2 * c.boost / 1000, 2), clock_ghz=c.boost,
        source=f"{source}: {c.sms} SMs at {c.boost:g} GHz boost; per-SM rates from the {paper}",
        chip=label, memory_options_gb=c.options, host_link_gbs=pcie, max_per_node=per_node, aliases=aliases,
    )


def _short(key: str) -> tuple[str, ...]:
    """`rtx-4070-ti` -> `4070-ti`: the number alone, as people type it."""
    return (key.removeprefix("rtx-"),) if key.startswith("rtx-") else ()


def _gf(key: str, label: str, card: Card, page: str) -> Device:
    return nv_row(key, f"NVIDIA GeForce {label}", card, page, aliases=_short(key))


_T = "turing-geforce"
_A = "ampere-geforce"
_ADA = "ada-geforce"
_BW = "blackwell-geforce"

GEFORCE: list[Device] = [
    _gf("rtx-2060", "RTX 2060 6GB", Card(_T, 30, 1.68, 6, 336, "pcie3"), _GF20),
    _gf("rtx-2070", "RTX 2070 8GB", Card(_T, 36, 1.62, 8, 448, "pcie3"), _GF20),
    _gf("rtx-2080", "RTX 2080 8GB", Card(_T, 46, 1.71, 8, 448, "pcie3"), _GF20),
    _gf("rtx-2080-ti", "RTX 2080 Ti 11GB", Card(_T, 68, 1.545, 11, 616, "pcie3"), _GF20),
    nv_row("titan-rtx", "NVIDIA TITAN RTX 24GB", Card("turing", 72, 1.77, 24, 672, "pcie3"),
           "nvidia.com/en-us/deep-learning-ai/products/titan-rtx/ (130 TFLOPS tensor)", aliases=("titanrtx",)),
    _gf("rtx-3060", "RTX 3060 12GB", Card(_A, 28, 1.777, 12, 360, "pcie4"), _GF30 + "rtx-3060-3060ti/"),
    _gf("rtx-3060-ti", "RTX 3060 Ti 8GB", Card(_A, 38, 1.665, 8, 448, "pcie4"), _GF30 + "rtx-3060-3060ti/"),
    _gf("rtx-3070", "RTX 3070 8GB", Card(_A, 46, 1.725, 8, 448, "pcie4"), _GF30 + "rtx-3070-3070ti/"),
    _gf("rtx-3080", "RTX 3080 10GB", Card(_A, 68, 1.71, 10, 760, "pcie4"), _GF30 + "rtx-3080-3080ti/"),
    _gf("rtx-3080-ti", "RTX 3080 Ti 12GB", Card(_A, 80, 1.665, 12, 912, "pcie4"), _GF30 + "rtx-3080-3080ti/"),
    _gf("rtx-3090", "RTX 3090 24GB", Card(_A, 82, 1.695, 24, 936, "pcie4"), _GF30 + "rtx-3090-3090ti/"),
    _gf("rtx-3090-ti", "RTX 3090 Ti 24GB", Card(_A, 84, 1.86, 24, 1008, "pcie4"), _GF30 + "rtx-3090-3090ti/"),
    _gf("rtx-4060", "RTX 4060 8GB", Card(_ADA, 24, 2.46, 8, 272, "pcie4", lanes=8), _GF40 + "rtx-4060-4060ti/"),
    _gf("rtx-4060-ti", "RTX 4060 Ti", Card(_ADA, 34, 2.535, 16, 288, "pcie4", lanes=8, options=(8, 16)),
        _GF40 + "rtx-4060-4060ti/"),
    _gf("rtx-4070", "RTX 4070 12GB", Card(_ADA, 46, 2.475, 12, 504, "pcie4"), _GF40 + "rtx-4070-family/"),
    _gf("rtx-4070-super", "RTX 4070 SUPER 12GB", Card(_ADA, 56, 2.475, 12, 504, "pcie4"), _GF40 + "rtx-4070-family/"),
    _gf("rtx-4070-ti", "RTX 4070 Ti 12GB", Card(_ADA, 60, 2.61, 12, 504, "pcie4"), _GF40 + "rtx-4070-family/"),
    _gf("rtx-4070-ti-super", "RTX 4070 Ti SUPER 16GB", Card(_ADA, 66, 2.61, 16, 672, "pcie4"),
        _GF40 + "rtx-4070-family/"),
    _gf("rtx-4080", "RTX 4080 16GB", Card(_ADA, 76, 2.505, 16, 716.8, "pcie4"), _GF40 + "rtx-4080-family/"),
    _gf("rtx-4080-super", "RTX 4080 SUPER 16GB", Card(_ADA, 80, 2.55, 16, 736, "pcie4"), _GF40 + "rtx-4080-family/"),
    _gf("rtx-4090", "RTX 4090 24GB", Card(_ADA, 128, 2.52, 24, 1008, "pcie4"), _GF40 + "rtx-4090/"),
    _gf("rtx-4090-d", "RTX 4090 D 24GB", Card(_ADA, 114, 2.52, 24, 1008, "pcie4"),
        "nvidia.cn/geforce/graphics-cards/40-series/rtx-4090-d/ (14,592 CUDA cores)"),
    _gf("rtx-5060", "RTX 5060 8GB", Card(_BW, 30, 2.497, 8, 448, "pcie5", lanes=8), _GF50 + "rtx-5060-family/"),
    _gf("rtx-5060-ti", "RTX 5060 Ti", Card(_BW, 36, 2.572, 16, 448, "pcie5", lanes=8, options=(8, 16)),
        _GF50 + "rtx-5060-family/"),
    _gf("rtx-5070", "RTX 5070 12GB", Card(_BW, 48, 2.512, 12, 672, "pcie5"), _GF50 + "rtx-5070-family/"),
    _gf("rtx-5070-ti", "RTX 5070 Ti 16GB", Card(_BW, 70, 2.452, 16, 896, "pcie5"), _GF50 + "rtx-5070-family/"),
    _gf("rtx-5080", "RTX 5080 16GB", Card(_BW, 84, 2.617, 16, 960, "pcie5"), _GF50 + "rtx-5080/"),
    _gf("rtx-5090", "RTX 5090 32GB", Card(_BW, 170, 2.407, 32, 1792, "pcie5"), _GF50 + "rtx-5090/"),
]

WORKSTATION: list[Device] = [
    nv_row("rtx-a2000", "NVIDIA RTX A2000", Card("ampere", 26, 1.2, 12, 288, "pcie4", options=(6, 12)),
           _PRO + "rtx-a2000/", aliases=("a2000",)),
    nv_row("rtx-a4000", "NVIDIA RTX A4000 16GB", Card("ampere", 48, 1.56, 16, 448, "pcie4"), _PRO + "rtx-a4000/",
           aliases=("a4000",)),
    nv_row("rtx-a4500", "NVIDIA RTX A4500 20GB", Card("ampere", 56, 1.65, 20, 640, "pcie4"),
           _PRO + "rtx-a4500/ (its 2-way NVLink bridge is not modelled: 4 cards talk over PCIe)",
           aliases=("a4500",)),
    nv_row("rtx-a5000", "NVIDIA RTX A5000 24GB", Card("ampere", 64, 1.695, 24, 768, "pcie4"),
           _PRO + "rtx-a5000/ (2-way NVLink bridge not modelled)", aliases=("a5000",)),
    nv_row("rtx-a6000", "NVIDIA RTX A6000 48GB", Card("ampere", 84, 1.8, 48, 768, "pcie4"),
           _PRO + "rtx-a6000/ (2-way NVLink bridge not modelled)", aliases=("a6000",)),
    nv_row("rtx-4000-ada", "NVIDIA RTX 4000 Ada Generation 20GB", Card("ada", 48, 2.175, 20, 360, "pcie4"),
           _PRO + "rtx-4000/ (estimated: the datasheet's tensor figure sits below the per-SM rate at boost)",
           aliases=("4000-ada", "rtx-4000-ada-generation")),
    nv_row("rtx-4500-ada", "NVIDIA RTX 4500 Ada Generation 24GB", Card("ada", 60, 2.58, 24, 432, "pcie4"),
           _PRO + "rtx-4500/ (634 TFLOPS FP8 with sparsity)", aliases=("4500-ada", "rtx-4500-ada-generation")),
    nv_row("rtx-5000-ada", "NVIDIA RTX 5000 Ada Generation 32GB", Card("ada", 100, 2.55, 32, 576, "pcie4"),
           _PRO + "rtx-5000/ (1044.4 TFLOPS FP8 with sparsity)", aliases=("5000-ada", "rtx-5000-ada-generation")),
    nv_row("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation 48GB", Card("ada", 142, 2.505, 48, 960, "pcie4"),
           _PRO + "rtx-6000/ (1457 TFLOPS FP8 with sparsity)", aliases=("6000-ada", "rtx-6000-ada-generation")),
    nv_row("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell 96GB", Card("blackwell-geforce", 188, 2.6, 96, 1792, "pcie5"),
           "nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/ (4000 AI TOPS = FP4 "
           "with sparsity, 125 TFLOPS FP32; FP16/FP8 estimated at the GeForce Blackwell per-SM rates)",
           aliases=("pro-6000", "rtx-pro-6000-blackwell", "rtx-pro-6000-blackwell-workstation-edition")),
    nv_row("rtx-pro-6000-max-q", "NVIDIA RTX PRO 6000 Blackwell Max-Q 96GB", Card("blackwell-geforce", 188, 2.285, 96, 1792, "pcie5"),
           "nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000-max-q/ (300 W, "
           "110 TFLOPS FP32, 1792 GB/s)", aliases=("pro-6000-max-q", "rtx-pro-6000-blackwell-max-q",
                                                  "rtx-pro-6000-blackwell-max-q-workstation-edition")),
    nv_row("rtx-pro-4000", "NVIDIA RTX PRO 4000 Blackwell 24GB", Card("blackwell-geforce", 70, 2.617, 24, 672, "pcie5"),
           "nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-4000/ (8,960 CUDA cores, "
           "46.9 TFLOPS FP32, 672 GB/s GDDR7; FP16/FP8 at the GeForce Blackwell per-SM rates)",
           aliases=("pro-4000", "rtx-pro-4000-blackwell")),
    nv_row("quadro-rtx-6000", "NVIDIA Quadro RTX 6000 24GB", Card("turing", 72, 1.77, 24, 672, "pcie3"),
           _PRO + "quadro-desktop-gpus/ (Quadro RTX 6000 datasheet: 4,608 CUDA cores, 130.5 TFLOPS tensor, 672 GB/s)",
           aliases=("rtx-6000-turing",)),
    nv_row("quadro-rtx-8000", "NVIDIA Quadro RTX 8000 48GB", Card("turing", 72, 1.77, 48, 672, "pcie3"),
           _PRO + "quadro-desktop-gpus/ (Quadro RTX 8000 datasheet: 4,608 CUDA cores, 130.5 TFLOPS tensor, 672 GB/s)",
           aliases=("rtx-8000",)),
]

DATACENTER_PCIE: list[Device] = [
    nv_row("t4", "NVIDIA T4 16GB", Card("turing", 40, 1.59, 16, 320, "pcie3"), _DC + "tesla-t4/ (65 TFLOPS FP16, "
           "130 TOPS INT8)", per_node=8, aliases=("tesla-t4",)),
    nv_row("v100-sxm2", "NVIDIA V100 SXM2", Card("volta", 80, 1.53, 32, 900, "nvlink2", mtype="hbm", options=(16, 32)),
           _DC + "v100/ (V100 datasheet: 125 TFLOPS tensor, 300 GB/s NVLink)", per_node=8,
           aliases=("v100", "tesla-v100", "v100-sxm2-32gb")),
    nv_row("v100-pcie", "NVIDIA V100 PCIe", Card("volta", 80, 1.38, 32, 900, "pcie3", mtype="hbm", options=(16, 32)),
           _DC + "v100/ (V100 datasheet: 112 TFLOPS tensor)", per_node=8, aliases=("v100-pcie-32gb",)),
    nv_row("p40", "NVIDIA Tesla P40 24GB", Card("pascal", 30, 1.531, 24, 346, "pcie3"),
           "images.nvidia.com/content/tesla/pdf/Tesla-P40-Product-Brief.pdf (3,840 CUDA cores, 346 GB/s GDDR5)",
           per_node=8, aliases=("tesla-p40",)),
    nv_row("m40", "NVIDIA Tesla M40 24GB", Card("maxwell", 24, 1.112, 24, 288, "pcie3"),
           "images.nvidia.com/content/tesla/pdf/NVIDIA-Tesla-M40-Datasheet.pdf (3,072 CUDA cores, 7 TFLOPS FP32, "
           "288 GB/s)", per_node=8, aliases=("tesla-m40", "m40-24gb", "tesla-m40-24gb")),
    nv_row("k80", "NVIDIA Tesla K80 (one of its two GPUs) 12GB", Card("kepler", 13, 0.875, 12, 240, "pcie3"),
           "images.nvidia.com/content/pdf/kepler/Tesla-K80-BoardSpec-07317-001-v05.pdf (per GPU: 2,496 CUDA cores, "
           "12 GB, 240 GB/s; the board's two GPUs do not share memory)", per_node=8, aliases=("tesla-k80",)),
    nv_row("a10", "NVIDIA A10 24GB", Card("ampere", 72, 1.695, 24, 600, "pcie4"), _DC + "products/a10-gpu/ (125 TFLOPS "
           "BF16, 250 TOPS INT8)", per_node=8),
    nv_row("a30", "NVIDIA A30 24GB", Card("ga100", 56, 1.44, 24, 933, "pcie4", mtype="hbm"),
           _DC + "products/a30-gpu/ (165 TFLOPS BF16, 330 TOPS INT8; its 2-way NVLink bridge not modelled)", per_node=8),
    nv_row("a40", "NVIDIA A40 48GB", Card("ampere", 84, 1.74, 48, 696, "pcie4"), _DC + "a40/ (149.7 TFLOPS BF16)",
           per_node=8),
    nv_row("l4", "NVIDIA L4 24GB", Card("ada", 58, 2.04, 24, 300, "pcie4"), _DC + "l4/ (242 TFLOPS BF16, 485 FP8 with "
           "sparsity)", per_node=8),
    nv_row("l40", "NVIDIA L40 48GB", Card("ada-l40", 142, 2.49, 48, 864, "pcie4"), _DC + "l40/ (181 TFLOPS BF16, "
           "362 FP8 dense)", per_node=8),
    nv_row("l40s", "NVIDIA L40S 48GB", Card("ada", 142, 2.52, 48, 864, "pcie4"), _DC + "l40s/ (L40S datasheet: 366 "
           "TFLOPS BF16, 733 FP8 dense)", per_node=8),
]

_LAPTOP40 = "nvidia.com/en-us/geforce/laptops/40-series/ (laptop specs)"
_LAPTOP30 = "nvidia.com/en-us/geforce/laptops/30-series/ (laptop specs)"


def _laptop(key: str, label: str, card: Card, page: str) -> Device:
    """A laptop GPU at the top of its boost-clock range (the highest-power designs); the driver calls it
    `NVIDIA GeForce <label> Laptop GPU`, with fewer SMs and less bandwidth than the desktop card of its number."""
    short = key.removeprefix("rtx-")
    return nv_row(key, f"NVIDIA GeForce {label} Laptop GPU", card,
                  f"{page}: {card.sms * 128:,} CUDA cores, {card.bw:g} GB/s",
                  per_node=1, aliases=(short, key.replace("-laptop", "-mobile"), f"{key}-gpu"))


LAPTOP: list[Device] = [
    _laptop("rtx-3050-laptop", "RTX 3050", Card(_A, 16, 1.74, 4, 192, lanes=8, options=(4, 6)), _LAPTOP30),
    _laptop("rtx-3060-laptop", "RTX 3060", Card(_A, 30, 1.703, 6, 336), _LAPTOP30),
    _laptop("rtx-3070-laptop", "RTX 3070", Card(_A, 40, 1.62, 8, 448), _LAPTOP30),
    _laptop("rtx-3080-laptop", "RTX 3080", Card(_A, 48, 1.71, 16, 448, options=(8, 16)), _LAPTOP30),
    _laptop("rtx-4050-laptop", "RTX 4050", Card(_ADA, 20, 2.37, 6, 192, lanes=8), _LAPTOP40),
    _laptop("rtx-4060-laptop", "RTX 4060", Card(_ADA, 24, 2.37, 8, 256, lanes=8), _LAPTOP40),
    _laptop("rtx-4070-laptop", "RTX 4070", Card(_ADA, 36, 2.175, 8, 256, lanes=8), _LAPTOP40),
    _laptop("rtx-4080-laptop", "RTX 4080", Card(_ADA, 58, 2.28, 12, 432), _LAPTOP40),
    _laptop("rtx-4090-laptop", "RTX 4090", Card(_ADA, 76, 2.04, 16, 576), _LAPTOP40),
]

OWNED_GPUS: list[Device] = GEFORCE + WORKSTATION + DATACENTER_PCIE + LAPTOP
