"""The process-group topology, the process launch, and the per-backend collective primitives."""

from .topology import Topology

__all__ = ["Topology"]
