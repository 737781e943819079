"""GPU presets for the planner's fit and step-time estimate (``--gpu``; docs/plan.md cites the sources).

Figures are the vendor datasheets' (SXM parts, the DGX systems' network):

* memory: the device memory in GiB a layout must fit (the datasheet's "80 GB" is what
  ``nvidia-smi`` reports as about 80 GiB; an H200's 141 GB as about 140 GiB);
* ``nvlink_gbps``: NVLink bandwidth per GPU and direction, GB/s -- half the datasheet's
  bidirectional total (H100/H200 900 GB/s, A100 600 GB/s);
* ``internode_gbps``: the node's network per GPU and direction, GB/s -- one NIC per GPU
  (DGX H100/H200: 8 x 400 Gb/s NDR InfiniBand = 50 GB/s each; DGX A100: 8 x 200 Gb/s HDR = 25 GB/s);
* ``peak_tflops``: dense BF16/FP16 tensor-core peak, without sparsity (H100/H200 SXM 989,
  A100 312).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    nvlink_gbps: float
    internode_gbps: float
    peak_tflops: float
    gpus_per_node: int = 8

    def bandwidth(self, within_node: bool) -> float:
        """Bytes per second one GPU sends in a collective: NVLink inside a node, its NIC across."""
        return (self.nvlink_gbps if within_node else self.internode_gbps) * 1e9


GPUS = {
    "h100": GPU("H100 SXM 80GB", 80.0, 450.0, 50.0, 989.0),
    "h200": GPU("H200 SXM 141GB", 140.0, 450.0, 50.0, 989.0),
    "a100-80g": GPU("A100 SXM 80GB", 80.0, 300.0, 25.0, 312.0),
    "a100-40g": GPU("A100 SXM 40GB", 40.0, 300.0, 25.0, 312.0),
}


def gpu_preset(name: str, memory_gib: float | None = None, gpus_per_node: int | None = None) -> GPU:
    """The preset ``name`` (a key of :data:`GPUS`), with its memory or node size overridden when given."""
    base = GPUS[name]
    return GPU(base.name, memory_gib if memory_gib is not None else base.memory_gib, base.nvlink_gbps,
               base.internode_gbps, base.peak_tflops, gpus_per_node or base.gpus_per_node)
