"""Registry behaviour with isolated entry points, and Hydra selection with overrides."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import torch

from cp_core import SimulatedCPMesh
from cp_core.backends import ROUND_ROBIN
from cp_core.errors import CPBackendLoadError, CPBackendNotFoundError, CPConfigError
from cp_core.registry import (
    Registry,
    available_backends,
    build_sharder,
    get_backend,
    resolve_config,
    use_registry,
)

GROUP = "cp_core.backends"


def ep(name: str, value: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=value, group=GROUP)


@pytest.fixture
def isolated():
    reg = Registry([
        ep("round_robin", "cp_core.backends:ROUND_ROBIN"),
        ep("contiguous", "cp_core.backends:CONTIGUOUS"),
        ep("broken", "cp_core_no_such_module_xyz:BACKEND"),
        ep("dup", "cp_core.backends:ROUND_ROBIN"),
        ep("dup", "cp_core.backends:CONTIGUOUS"),
        ep("not_backend", "cp_core.registry:KNOWN_EXTRAS"),
        ep("wrong_name", "cp_core.backends:CONTIGUOUS"),
    ])
    with use_registry(reg):
        yield reg


def test_framework_backends_come_from_entry_points() -> None:
    names = set(available_backends())
    assert {"identity", "contiguous", "round_robin", "aux_only"} <= names
    assert get_backend("round_robin") is ROUND_ROBIN


def test_unknown_name_lists_known(isolated: Registry) -> None:
    with pytest.raises(CPBackendNotFoundError, match=r"unknown CP backend 'nope'.*contiguous.*round_robin"):
        get_backend("nope")


@pytest.mark.parametrize("name,extra", [("te_thd", "te"), ("magi", "magi"), ("blockdiag", "blockdiag")])
def test_known_but_missing_gives_install_line(isolated: Registry, name: str, extra: str) -> None:
    with pytest.raises(CPBackendNotFoundError, match=rf"pip install 'cp-core\[{extra}\]'"):
        get_backend(name)


def test_broken_plugin_raises_chained_only_when_selected(isolated: Registry) -> None:
    assert "broken" in isolated.available()
    assert get_backend("contiguous").name == "contiguous"  # the broken one hides nothing
    with pytest.raises(CPBackendLoadError, match="failed to import") as info:
        get_backend("broken")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    loaded, errors = isolated.load_all()
    assert {"round_robin", "contiguous"} <= set(loaded)
    assert set(errors) == {"broken", "dup", "not_backend", "wrong_name"}


def test_duplicates_refused(isolated: Registry) -> None:
    with pytest.raises(CPBackendLoadError, match="more than once"):
        get_backend("dup")


def test_entry_point_must_hold_matching_backend(isolated: Registry) -> None:
    with pytest.raises(CPBackendLoadError, match="expected a cp_core.registry.Backend"):
        get_backend("not_backend")
    with pytest.raises(CPBackendLoadError, match="named 'contiguous'"):
        get_backend("wrong_name")


def test_registry_view_is_read_only(isolated: Registry) -> None:
    view = isolated.entry_points()
    with pytest.raises(TypeError):
        view["x"] = None  # type: ignore[index]


def test_config_validation_errors() -> None:
    with pytest.raises(CPConfigError, match=r"unknown key cp.pad_multple.*pad_multiple"):
        resolve_config({"backend": "contiguous", "pad_multple": 4})
    with pytest.raises(CPConfigError, match=r"cp.size"):
        resolve_config({"backend": "contiguous", "size": 0})
    with pytest.raises(CPConfigError, match="needs window"):
        resolve_config({"backend": "round_robin", "attention": "sliding_window"})
    with pytest.raises(CPConfigError, match="backend: <name>"):
        resolve_config({"size": 2})


def test_size_comes_from_the_mesh_when_unset() -> None:
    sharder = build_sharder({"backend": "round_robin"}, SimulatedCPMesh(1, 4))
    sharder.shard({"input_ids": torch.ones(1, 16, dtype=torch.long),
                   "labels": torch.ones(1, 16, dtype=torch.long)})
    # Head-tail at cp=4 on 16 tokens: rank 1 holds chunks 1 and 6 of 2 tokens.
    assert sharder.shard_layout.local_token_global_indices.tolist() == [2, 3, 12, 13]
    assert build_sharder({"backend": "identity"}, None) is not None
    with pytest.raises(CPConfigError, match=r"cp.size=1 but the CP mesh has 2"):  # identity: 1
        build_sharder({"backend": "identity"}, SimulatedCPMesh(0, 2))


def test_mesh_size_must_match_config() -> None:
    with pytest.raises(CPConfigError, match=r"cp.size=4 but the CP mesh has 2"):
        build_sharder({"backend": "round_robin", "size": 4}, SimulatedCPMesh(0, 2))


def _compose(overrides: list[str]):
    from cp_core.hydra_config import compose_app_config

    return compose_app_config("cp_plan", overrides)


def test_hydra_compose_selects_and_overrides() -> None:
    cfg = _compose(["cp=contiguous", "cp.pad_multiple=4", "cp.size=8"])
    backend, parsed = resolve_config(cfg.cp)
    assert backend.name == "contiguous" and parsed.pad_multiple == 4 and parsed.size == 8
    sharder = build_sharder(cfg.cp, SimulatedCPMesh(3, 8))
    sharder.shard({"input_ids": torch.ones(1, 5, dtype=torch.long),
                   "labels": torch.ones(1, 5, dtype=torch.long)})
    assert sharder.shard_layout.padded_seq_len == 32


def test_hydra_bad_override_is_a_clear_error() -> None:
    cfg = _compose(["cp=round_robin", "+cp.pad_multple=4"])
    with pytest.raises(CPConfigError, match="unknown key cp.pad_multple"):
        resolve_config(cfg.cp)
    cfg = _compose(["cp=round_robin", "cp.attention=sideways"])
    with pytest.raises(CPConfigError, match="cp.attention"):
        resolve_config(cfg.cp)


def test_installed_backend_without_yaml_is_selectable(tmp_path: Path) -> None:
    # A config dir whose cp group lacks round_robin.yaml: the registry fills it in.
    (tmp_path / "cp").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - cp: identity\n  - _self_\n")
    (tmp_path / "cp" / "identity.yaml").write_text("backend: identity\nsize: 1\n")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from cp_core.hydra_config import register_backend_configs

    register_backend_configs(tmp_path)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="config", overrides=["cp=aux_only", "cp.size=4"])
    assert cfg.cp.backend == "aux_only" and cfg.cp.size == 4


def test_transports_load_through_the_same_rules() -> None:
    """The transport group shares the backends' loader: a duplicate target is refused by
    name, a broken import is chained, the transport protocol is checked at load."""
    import importlib.metadata as md

    from cp_core.plugins import EntryPointGroup
    from cp_core.runtime.transports.registry import check_transport

    def ep(name: str, value: str) -> md.EntryPoint:
        return md.EntryPoint(name, value, "cp_core.transports")

    group = EntryPointGroup("cp_core.transports", "attention transport", check_transport,
                            entry_points=[
                                ep("p2p", "cp_core.runtime.transports.p2p:p2p_sdpa"),
                                ep("p2p", "somewhere.else:p2p_sdpa"),
                                ep("gone", "no_such_module_xyz:fn"),
                                ep("not_a_call", "cp_core.errors:__doc__"),
                                ep("too_few", "cp_core.comm.mesh:cp_size"),
                                ep("allgather",
                                   "cp_core.runtime.transports.allgather:allgather_sdpa")],
                            load_error=CPConfigError, not_found_error=CPConfigError)
    assert callable(group.get("allgather"))
    with pytest.raises(CPConfigError, match=r"more than once.*somewhere.else"):
        group.get("p2p")
    with pytest.raises(CPConfigError, match="failed to import") as info:
        group.get("gone")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    with pytest.raises(CPConfigError, match="not callable"):
        group.get("not_a_call")
    with pytest.raises(CPConfigError, match="does not take the transport call"):
        group.get("too_few")
    with pytest.raises(CPConfigError, match=r"unknown attention transport 'nope'.*allgather"):
        group.get("nope")
