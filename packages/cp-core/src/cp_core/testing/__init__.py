"""Test utilities shipped with cp_core: the multi-rank pool, reference model and conformance suite."""
