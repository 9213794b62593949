"""Hardware the planner plans for: accelerators and cluster shapes, built in or read from TOML.

Units are the vendors': TFLOP/s (dense, no sparsity), GB = 1e9 bytes, GB/s, W.

Bandwidth conventions. Vendors quote NVLink as the aggregate of both directions (H100: 900 GB/s
= 450 GB/s each way); a ring collective is limited by what one GPU can send one way, so cluster
shapes store bandwidth per GPU per direction. Worked examples elsewhere sometimes divide by the
bidirectional figure ("NVLink at 600 GB/s ... (bidirectional)"); the collective functions in
comm.py take whatever bandwidth they are given, and the tests reproduce such examples with theirs.
The often-quoted "18x drop" from NVLink (900, both ways) to InfiniBand (50 GB/s, one way) compares
unlike figures: one way to one way it is 450 / 50 = 9x.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gridtrain import tomlread


class SpecError(ValueError):
    """An unknown name or a malformed description, with the nearest valid names in the message."""


@dataclass(frozen=True)
class AcceleratorSpec:
    name: str
    """Display name."""
    bf16_tflops: float
    """Dense 16-bit tensor-core peak, TFLOP/s (V100 has no bf16: its fp16 peak)."""
    hbm_gb: float
    """Device memory, GB (1e9 bytes)."""
    hbm_gb_per_s: float
    """Device memory bandwidth, GB/s."""
    power_w: float
    """Board power (TDP), W; 0 when the vendor does not publish it."""
    link_gb_per_s: float
    """Scale-up link (NVLink, TPU ICI) per device as the vendor quotes it: both directions, GB/s."""
    fp8_tflops: float = 0.0
    """Dense FP8 tensor-core peak, TFLOP/s; 0 where the device has no FP8 matmul (FP8 training
    then runs its matmuls at the 16-bit peak)."""

    @property
    def peak_flops(self) -> float:
        """Dense 16-bit peak in FLOP/s: what MFU divides by."""
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def ridge_flops_per_byte(self) -> float:
        """Roofline ridge point: peak FLOP/s / HBM bytes/s (Williams et al. 2009; H100: 989e12/3352e9 = 295)."""
        return self.peak_flops / (self.hbm_gb_per_s * 1e9)


# Vendor data sheets (NVIDIA V100, A100, H100, H200, B200; Google Cloud TPU v5p, 459 TFLOP/s bf16).
# B200: the "~5,000" TFLOP/s sometimes quoted is the sparse figure (4.5 PF); the dense bf16 peak is
# 2.25 PF (HGX B200 data sheet).
ACCELERATORS: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        AcceleratorSpec("V100", 125, 32, 900, 300, 300),
        AcceleratorSpec("A100-40GB", 312, 40, 1555, 400, 600),
        AcceleratorSpec("A100-80GB", 312, 80, 2039, 400, 600),
        # FP8, dense (the data sheets' "3,958 / 3,026 TFLOPS" are with sparsity): twice the bf16 peak.
        AcceleratorSpec("H100-SXM", 989, 80, 3352, 700, 900, 1979),
        AcceleratorSpec("H100-PCIe", 756, 80, 2000, 350, 600, 1513),
        # torchtitan's benchmark H100s (Grand Teton, llama3_h100_202412_torchtitan.md): 96 GB of
        # HBM2e at 2.4 TB/s, run at a 500 W limit. Its peak lies between the SXM's and the NVL's,
        # and is not published: torchtitan divides by the SXM's 989, and so does this entry.
        AcceleratorSpec("H100-96GB", 989, 96, 2400, 500, 900, 1979),
        AcceleratorSpec("H200", 989, 141, 4800, 700, 900, 1979),
        AcceleratorSpec("B200", 2250, 192, 8000, 1000, 1800, 4500),
        # No NVLink: PCIe Gen4 x16, 64 GB/s both directions. The A10G (AWS) has no published power.
        AcceleratorSpec("L40S", 362, 48, 864, 350, 64, 733),
        AcceleratorSpec("A10G", 70, 24, 600, 0, 64),
        # Google does not publish a per-chip power for v5p; ICI is 4,800 Gb/s = 600 GB/s.
        AcceleratorSpec("TPU-v5p", 459, 95, 2765, 0, 600),
    )
}

ACCELERATOR_ALIASES = {"h100": "H100-SXM", "a100": "A100-80GB", "v5p": "TPU-v5p", "tpuv5p": "TPU-v5p"}


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def accelerator_of_device(device_name: str) -> AcceleratorSpec | None:
    """The spec of a device as torch names it ('NVIDIA H100 80GB HBM3' is the SXM part, 'NVIDIA
    H100 PCIe', 'NVIDIA A100-SXM4-40GB'): the specs whose model (H100) the name holds, the one
    whose every part (PCIe, 40GB) it holds first; None for a device not in the table."""
    key = _key(device_name)
    found = [spec for spec in ACCELERATORS.values() if _key(spec.name).split("-")[0] in key]
    exact = [spec for spec in found if all(part in key for part in _key(spec.name).split("-"))]
    return (exact or found or [None])[0]


def accelerator(name: str, extra: dict[str, AcceleratorSpec] | None = None) -> AcceleratorSpec:
    """A built-in or user accelerator by name (case and '-'/'_'/' ' insensitive; 'h100' is the
    SXM part, 'a100' the 80 GB one). Unknown names raise SpecError with the nearest names."""
    table = {**ACCELERATORS, **(extra or {})}
    by_key = {_key(n): spec for n, spec in table.items()}
    key = _key(name)
    key = _key(ACCELERATOR_ALIASES.get(key.replace("-", ""), key))
    if key in by_key:
        return by_key[key]
    near = difflib.get_close_matches(key, list(by_key), n=3, cutoff=0.3)
    hint = f"; did you mean {', '.join(by_key[k].name for k in near)}?" if near else ""
    raise SpecError(f"unknown accelerator {name!r}: known are {', '.join(sorted(table))}{hint} "
                    "(describe your own in a TOML [accelerator.NAME] table)")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    """Display name."""
    accelerator: AcceleratorSpec
    """The device in every slot."""
    gpus_per_node: int
    """Devices on one scale-up domain (NVLink/NVSwitch): the natural bound of tensor parallelism."""
    intra_node_gb_per_s: float
    """Bandwidth per GPU per direction inside a node, GB/s."""
    intra_node_latency_s: float
    """Per-step latency of a collective inside a node, s."""
    inter_node_gb_per_s: float
    """Bandwidth per GPU per direction between nodes (its NIC, rail-optimized), GB/s."""
    inter_node_latency_s: float
    """Per-step latency of a collective across nodes, s."""
    nodes_per_pod: int = 0
    """Nodes under full bisection bandwidth (0: the whole cluster is one pod)."""
    oversubscription: float = 1.0
    """Between pods the fabric is oversubscribed by this factor (Llama 3 paper: 1:7)."""
    price_per_gpu_hour: float = 2.0
    """Rental price, $ per GPU-hour (an assumed round figure for H100 rental)."""
    gloo_step_s: float | None = None
    """Set where the ranks talk over gloo (local CPU ranks, `--gpu local`): each ring step of every
    collective call costs this, measured, in place of NCCL's tuning model, and reduce-scatters run as
    the all-reduces gloo has instead (placement)."""

    @property
    def cross_pod_gb_per_s(self) -> float:
        return self.inter_node_gb_per_s / self.oversubscription


def _dgx_h100_llama3() -> ClusterSpec:
    # Llama 3 paper (Dubey et al. 2024), sec. 3.3.1 (Meta's Grand Teton servers): 8 H100 per server
    # on NVSwitch (900 GB/s both ways), 400 Gb/s per GPU between servers = 50 GB/s per GPU, pods
    # of 3,072 GPUs (384 servers).
    # Latencies: Hugging Face's Smol Training Playbook (2025): ~13 us inside a node, ~55 us across two.
    # Oversubscription between pods: 1:7 (Llama 3 paper, section 3.3.1).
    return ClusterSpec("dgx-h100", ACCELERATORS["H100-SXM"], 8, 450, 13e-6, 50, 55e-6,
                       nodes_per_pod=384, oversubscription=7.0)


def _selene_a100() -> ClusterSpec:
    # Narayanan et al. 2021 (reference/README.md): 8 A100-80GB per node on NVLink/NVSwitch
    # (600 GB/s both ways), 8x200 Gb/s HDR InfiniBand per node = 25 GB/s per GPU.
    return ClusterSpec("selene-a100", ACCELERATORS["A100-80GB"], 8, 300, 13e-6, 25, 55e-6)


def _grand_teton_h100_96gb() -> ClusterSpec:
    # torchtitan's benchmark hosts: 8 H100 (96 GB) per host fully connected by NVLink, 400 Gb/s
    # RDMA per GPU between hosts = 50 GB/s; latencies as dgx-h100's.
    return ClusterSpec("grand-teton-h100-96gb", ACCELERATORS["H100-96GB"], 8, 450, 13e-6, 50, 55e-6)


CLUSTERS = {"dgx-h100": _dgx_h100_llama3, "selene-a100": _selene_a100, "grand-teton-h100-96gb": _grand_teton_h100_96gb}


def cluster(name: str, extra: dict[str, ClusterSpec] | None = None) -> ClusterSpec:
    """A built-in or user cluster shape by name; unknown names raise SpecError."""
    table = {n: f() for n, f in CLUSTERS.items()} | (extra or {})
    if name in table:
        return table[name]
    near = difflib.get_close_matches(name, list(table), n=3, cutoff=0.3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise SpecError(f"unknown cluster {name!r}: known are {', '.join(sorted(table))}{hint}")


@dataclass(frozen=True)
class ClusterTotals:
    num_gpus: int
    num_nodes: int
    num_pods: int
    memory_bytes: float
    peak_flops: float


def cluster_totals(spec: ClusterSpec, num_gpus: int) -> ClusterTotals:
    """Nodes = ceil(GPUs / GPUs per node); pods likewise; total HBM and dense peak.

    Worked example, the Llama 3 cluster (Dubey et al. 2024, sec. 3.3.1): 24,576 H100 = 3,072
    servers = 8 pods; 1.97 PB of HBM; 24.3 EFLOP/s peak."""
    nodes = math.ceil(num_gpus / spec.gpus_per_node)
    pods = math.ceil(nodes / spec.nodes_per_pod) if spec.nodes_per_pod else 1
    acc = spec.accelerator
    return ClusterTotals(num_gpus, nodes, pods, num_gpus * acc.hbm_bytes, num_gpus * acc.peak_flops)


def _check_keys(kind: str, name: str, table: dict[str, Any], allowed: list[str]) -> None:
    for key in table:
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise SpecError(f"[{kind}.{name}]: unknown key {key!r}{hint}; valid keys: {', '.join(allowed)}")


def accelerator_from_table(name: str, table: dict[str, Any]) -> AcceleratorSpec:
    """An AcceleratorSpec from a TOML table whose keys are the field names (power_w and fp8_tflops
    default to 0)."""
    allowed = [f.name for f in fields(AcceleratorSpec) if f.name != "name"]
    _check_keys("accelerator", name, table, allowed)
    values = {"power_w": 0.0, "fp8_tflops": 0.0, **table}
    missing = [k for k in allowed if k not in values]
    if missing:
        raise SpecError(f"[accelerator.{name}] lacks {', '.join(missing)}")
    return AcceleratorSpec(name=name, **{k: float(values[k]) for k in allowed})


def cluster_from_table(name: str, table: dict[str, Any],
                       accelerators: dict[str, AcceleratorSpec] | None = None) -> ClusterSpec:
    """A ClusterSpec from a TOML table; `accelerator` names a built-in or one of `accelerators`."""
    allowed = [f.name for f in fields(ClusterSpec) if f.name != "name"]
    _check_keys("cluster", name, table, allowed)
    required = ["accelerator", "gpus_per_node", "intra_node_gb_per_s", "intra_node_latency_s",
                "inter_node_gb_per_s", "inter_node_latency_s"]
    missing = [k for k in required if k not in table]
    if missing:
        raise SpecError(f"[cluster.{name}] lacks {', '.join(missing)}")
    values: dict[str, Any] = dict(table)
    values["accelerator"] = accelerator(str(table["accelerator"]), accelerators)
    for key in ("gpus_per_node", "nodes_per_pod"):
        if key in values:
            values[key] = int(values[key])
    return ClusterSpec(name=name, **values)


@dataclass
class HardwareFile:
    accelerators: dict[str, AcceleratorSpec] = field(default_factory=dict)
    clusters: dict[str, ClusterSpec] = field(default_factory=dict)


def parse_hardware(doc: dict[str, Any]) -> HardwareFile:
    """Parse `[accelerator.NAME]` and `[cluster.NAME]` tables (already-loaded TOML).

        [accelerator.mi300x]
        bf16_tflops = 1307
        hbm_gb = 192
        hbm_gb_per_s = 5300
        power_w = 750
        link_gb_per_s = 896

        [cluster.my-pod]
        accelerator = "mi300x"
        gpus_per_node = 8
        intra_node_gb_per_s = 448
        intra_node_latency_s = 15e-6
        inter_node_gb_per_s = 50
        inter_node_latency_s = 60e-6
    """
    _check_keys("top", "level", doc, ["accelerator", "cluster"])
    out = HardwareFile()
    for name, table in doc.get("accelerator", {}).items():
        out.accelerators[name] = accelerator_from_table(name, table)
    for name, table in doc.get("cluster", {}).items():
        out.clusters[name] = cluster_from_table(name, table, out.accelerators)
    return out


def load_hardware(path: str | Path) -> HardwareFile:
    """Read a TOML file of user accelerators and clusters."""
    with open(path, "rb") as f:
        return parse_hardware(tomlread.load(f))


def tensor_core_peak_flops(num_sms: int, tensor_cores_per_sm: int, flops_per_core_cycle: int,
                           clock_hz: float) -> float:
    """Dense peak = SMs x tensor cores per SM x FLOPs per core per cycle x clock.

    Worked example, H100 SXM (NVIDIA's Hopper architecture whitepaper): 132 SMs x 4 = 528 tensor
    cores, each a [16x4].[4x8] product per cycle = 512 multiply-adds = 1,024 FLOPs; at the 1.83 GHz
    boost clock that is 989 TFLOP/s."""
    return num_sms * tensor_cores_per_sm * flops_per_core_cycle * clock_hz
