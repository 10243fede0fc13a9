"""The te_thd backend through the registry and Hydra: entry point, YAML, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cp_core import SimulatedCPMesh
from cp_core.errors import CPConfigError
from cp_core.registry import available_backends, build_sharder, get_backend, resolve_config

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"


def test_registered_through_its_entry_point() -> None:
    assert "te_thd" in available_backends()
    backend = get_backend("te_thd")
    assert backend.name == "te_thd" and "THD" in backend.description


def test_yaml_holds_the_model_defaults() -> None:
    node = yaml.safe_load((CONFIG_DIR / "cp" / "te_thd.yaml").read_text())
    defaults = get_backend("te_thd").default_node()
    assert node.pop("size") == 2
    defaults.pop("size")
    assert node == defaults  # every field, and nothing else


def test_hydra_compose_with_overrides() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from cp_core.hydra_config import register_backend_configs

    register_backend_configs(CONFIG_DIR)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "cp=te_thd", "cp.size=4", "cp.cp_comm_type=a2a", "cp.seq_lens_sentinel=-1"])
        bad = compose(config_name="config", overrides=["cp=te_thd", "cp.use_te=sometimes"])
    _, parsed = resolve_config(cfg.cp)
    assert parsed.cp_comm_type == "a2a" and parsed.seq_lens_sentinel == -1 and parsed.size == 4
    assert build_sharder(cfg.cp, SimulatedCPMesh(1, 4)).local_token_global_indices is None
    with pytest.raises(CPConfigError, match="cp.use_te"):
        resolve_config(bad.cp)
