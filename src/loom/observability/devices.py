"""The accelerators loom knows by name, one record each with every figure a step's time
depends on and where each figure comes from.

A record is one device as torch sees it: one GCD of an MI250X, one stack (tile) of a Max
1550. Training's MFU reads its peak (`loom.observability.flops`); `loom plan` prices a step
from its figures and from nothing else: a device not here is refused, or described by
`loom plan --device-peak-tflops --device-bandwidth --device-memory-bandwidth`.

Peaks are dense (no sparsity) matmul FLOP/s in the dtype torch computes in (fp32 is plain
fp32: torch's default matmul precision, no TF32); `hbm_tbs` the memory bandwidth;
`link_gbs` what one device sends in one direction to its node's peers (a collective within
`node_size` devices), `network_gbs` its share of the node's network links (a collective
spanning nodes). The network is the system's, not the device's: each record names the
system its figure is read from (one 400 Gb/s NIC per GPU, as NVIDIA's DGX and AMD's
Instinct platforms ship, is 50 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    name: str
    """Matched case-insensitively inside torch's device name ("NVIDIA H200" finds "H200")."""
    tflops: dict[str, float]
    """Dense peak TFLOP/s per compute dtype ("bf16", "fp32"); empty: measured (the CPU)."""
    float8_tflops: float | None
    """Dense float8 TFLOP/s; None without float8 matmul units (float8 runs at bf16 speed)."""
    hbm_tbs: float | None
    """Memory bandwidth, TB/s; None: no figure (the CPU, whose traffic terms are not priced)."""
    link_gbs: float
    network_gbs: float
    node_size: int
    source: str
    """Where the figures come from."""

    def peak(self, dtype: torch.dtype) -> float | None:
        """FLOP/s of a matmul in `dtype`, None where the record has no figure for it."""
        tflops = self.tflops.get("fp32" if dtype == torch.float32 else "bf16")
        return None if tflops is None else tflops * 1e12

    def bandwidth(self, group: int) -> float:
        """Bytes/s per device for a collective over `group` consecutive ranks."""
        return (self.link_gbs if group <= self.node_size else self.network_gbs) * 1e9


DGX = "8 GPUs a node, one 400 Gb/s NIC each (50 GB/s)"
INSTINCT = "8 GPUs a node on the AMD Instinct platform, one 400 Gb/s NIC each (50 GB/s)"

DEVICES: tuple[Device, ...] = (
    # Most specific first: the first name found in torch's device name wins.
    Device("H100 NVL", {"bf16": 835.5, "fp32": 60.0}, 1670.5, 3.9, 64.0, 50.0, 8,
           "NVIDIA H100 NVL datasheet (bf16, fp8 halved from the sparsity figures, HBM3 "
           "3.9 TB/s); link: PCIe Gen5 x16 (its NVLink bridge joins pairs only); " + DGX),
    Device("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}, 1513.0, 2.0, 64.0, 50.0, 8,
           "NVIDIA H100 PCIe datasheet (HBM2e 2.0 TB/s); link: PCIe Gen5 x16; " + DGX),
    Device("GH200", {"bf16": 989.4, "fp32": 66.9}, 1978.9, 4.0, 450.0, 25.0, 4,
           "NVIDIA GH200 datasheet (its H100 GPU; HBM3 4.0 TB/s; NVLink 900 GB/s both "
           "ways); network: 4 superchips a node, one 200 Gb/s Slingshot NIC each (HPE Cray "
           "EX254n)"),  # before "H100" and "H200": "GH200" contains "H200"
    Device("H100", {"bf16": 989.4, "fp32": 66.9}, 1978.9, 3.35, 450.0, 50.0, 8,
           "NVIDIA H100 SXM5 datasheet (HBM3 3.35 TB/s; NVLink 900 GB/s both ways); DGX H100 "
           "datasheet: " + DGX),
    Device("H200", {"bf16": 989.4, "fp32": 66.9}, 1978.9, 4.8, 450.0, 50.0, 8,
           "NVIDIA H200 SXM datasheet (HBM3e 4.8 TB/s; NVLink 900 GB/s both ways); HGX H200: "
           + DGX),
    Device("B200", {"bf16": 2250.0, "fp32": 80.0}, 4500.0, 8.0, 900.0, 50.0, 8,
           "NVIDIA DGX B200 datasheet per GPU (HBM3e 8 TB/s; NVLink 5 1.8 TB/s both ways); "
           + DGX),
    Device("A100", {"bf16": 312.0, "fp32": 19.5}, None, 2.039, 300.0, 25.0, 8,
           "NVIDIA A100 80GB SXM datasheet (HBM2e 2,039 GB/s; NVLink 600 GB/s both ways; no "
           "float8); DGX A100: 8 GPUs a node, one 200 Gb/s NIC each (25 GB/s)"),
    Device("L40S", {"bf16": 362.05, "fp32": 91.6}, 733.0, 0.864, 32.0, 25.0, 8,
           "NVIDIA L40S datasheet (GDDR6 864 GB/s, no NVLink); link: PCIe Gen4 x16; network: "
           "8 GPUs a node, one 200 Gb/s NIC each (25 GB/s)"),
    Device("MI355X", {"bf16": 2500.0, "fp32": 157.3}, 5000.0, 8.0, 537.6, 50.0, 8,
           "AMD Instinct MI355X datasheet (HBM3E 8 TB/s; 7 Infinity Fabric links of 153.6 "
           "GB/s both ways); " + INSTINCT),
    Device("MI325X", {"bf16": 1307.4, "fp32": 163.4}, 2614.9, 6.0, 448.0, 50.0, 8,
           "AMD Instinct MI325X datasheet (HBM3E 6 TB/s; 7 Infinity Fabric links of 128 GB/s "
           "both ways); " + INSTINCT),
    Device("MI300X", {"bf16": 1307.4, "fp32": 163.4}, 2614.9, 5.3, 448.0, 50.0, 8,
           "AMD Instinct MI300X datasheet (HBM3 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s "
           "both ways); " + INSTINCT),
    Device("MI250X", {"bf16": 191.5, "fp32": 47.9}, None, 1.6384, 50.0, 12.5, 8,
           "AMD Instinct MI250X datasheet halved per GCD (383 bf16, 95.7 fp32 matrix TFLOP/s, "
           "3.2768 TB/s; no float8); OLCF Frontier user guide: 8 GCDs a node, 50 GB/s "
           "Infinity Fabric between packages, 4 Slingshot NICs of 25 GB/s"),
    Device("Max 1550", {"bf16": 298.2, "fp32": 18.6}, None, 1.6384, 100.0, 16.7, 12,
           "per stack: ALCF Aurora machine overview (448 active EUs a stack, 6 GPUs = 12 "
           "stacks a node, 8 Slingshot-11 NICs of 200 Gb/s: 16.7 GB/s a stack); Intel: 512 "
           "bf16 and 32 fp32 FLOPs per EU a clock, at the 1.3 GHz ezpz's MFU uses (the "
           "published agpt-2b figures' peak); Intel ark: 3.2768 TB/s a GPU, no float8; "
           "Xe Link 100 GB/s a stack within the node: assumed (no per-link rate published)"),
)

CPU = Device("cpu", {}, None, None, 5.0, 1.0, 8,
             "measured matmul peak; gloo over loopback (5 GB/s) and TCP (1 GB/s): assumed")
"""The CPU: its peak is measured (`loom.observability.flops.measured_peak`)."""


def known_device(name: str) -> Device | None:
    """The first record whose name is in `name` (case-insensitive), else None."""
    if name.lower() == "cpu":
        return CPU
    return next((d for d in DEVICES if d.name.lower() in name.lower()), None)
