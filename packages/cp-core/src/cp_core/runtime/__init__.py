"""Consumes a plan, never plans: the SDPA door, the HF layer, kernels and transports."""
