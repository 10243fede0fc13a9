"""Attention kernels: the blocked reference kernel and the fused per-piece kernels."""
