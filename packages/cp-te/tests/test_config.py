"""The te_thd backend through the registry and Hydra: entry point, YAML, overrides."""

from __future__ import annotations

import pytest

from cp_core import SimulatedCPMesh
from cp_core.errors import CPConfigError
from cp_core.registry import available_backends, build_sharder, get_backend, resolve_config


def test_registered_through_its_entry_point() -> None:
    assert "te_thd" in available_backends()
    backend = get_backend("te_thd")
    assert backend.name == "te_thd" and "THD" in backend.description


def test_hydra_node_holds_the_model_defaults() -> None:
    from cp_core.hydra_config import compose_app_config

    node = dict(compose_app_config("cp_plan", ["cp=te_thd"]).cp)
    assert node == get_backend("te_thd").default_node()  # every field, and nothing else


def test_hydra_compose_with_overrides() -> None:
    from cp_core.hydra_config import compose_app_config

    cfg = compose_app_config("cp_plan", [
        "cp=te_thd", "cp.size=4", "cp.cp_comm_type=a2a", "cp.seq_lens_sentinel=-1"])
    bad = compose_app_config("cp_plan", ["cp=te_thd", "cp.use_te=sometimes"])
    _, parsed = resolve_config(cfg.cp)
    assert parsed.cp_comm_type == "a2a" and parsed.seq_lens_sentinel == -1 and parsed.size == 4
    assert build_sharder(cfg.cp, SimulatedCPMesh(1, 4)).local_token_global_indices is None
    with pytest.raises(CPConfigError, match="cp.use_te"):
        resolve_config(bad.cp)
