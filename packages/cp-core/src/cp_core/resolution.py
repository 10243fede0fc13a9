"""How :class:`~cp_core.sharder.ContextParallelSharder`'s keyword constructor reads its arguments.

Two forms, as in NeMo AutoModel's contract (``docs/nemo.md``):

* the **strategy form** names the callables (``shard_batch=``, optionally
  ``local_token_global_indices=`` and ``shard_layout=``) and a mesh;
* the **resolution form** names what the step has (``model``, ``device_mesh``, ``batch``) and
  lets the registry build the backend: ``config=`` (or the model's ``cp_config`` attribute)
  names it, the default is the framework round-robin layout (identity with CP inactive).

The two forms are mutually exclusive. Meshes come either as ``cp_mesh=`` / ``tp_mesh=``
(1-D meshes, this library's spelling) or as one ``device_mesh`` whose ``"cp"`` and ``"tp"``
dims are read by name (NeMo's spelling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from cp_core.errors import CPConfigError
from cp_core.comm.mesh import cp_size


@dataclass(frozen=True)
class Meshes:
    """The CP and TP meshes a sharder is built for (None: that kind of parallelism is off)."""

    cp_mesh: Any = None
    tp_mesh: Any = None


def _named_dim(device_mesh: Any, name: str) -> Any:
    return device_mesh[name] if name in tuple(device_mesh.mesh_dim_names or ()) else None


def meshes_from_args(device_mesh: Any, cp_mesh: Any, tp_mesh: Any) -> Meshes:
    """The 1-D CP/TP meshes from either ``device_mesh`` or ``cp_mesh``/``tp_mesh``.

    A ``device_mesh`` must name its dims (``mesh_dim_names``): one without names could be a
    CP mesh or a data-parallel one, and guessing wrong would silently turn CP off.
    """
    if device_mesh is None:
        return Meshes(cp_mesh, tp_mesh)
    if cp_mesh is not None or tp_mesh is not None:
        raise TypeError(
            "device_mesh is mutually exclusive with cp_mesh/tp_mesh: pass the full mesh "
            "(its 'cp' and 'tp' dims are read by name) or the 1-D meshes, not both"
        )
    if not hasattr(device_mesh, "mesh_dim_names"):
        raise CPConfigError(
            f"device_mesh ({type(device_mesh).__name__}) has no mesh_dim_names to find its "
            "'cp' dim by; pass a 1-D CP mesh as cp_mesh= instead"
        )
    return Meshes(_named_dim(device_mesh, "cp"), _named_dim(device_mesh, "tp"))


def check_form(*, model: Any, batch: Any, config: Any, shard_batch: Any,
               local_token_global_indices: Any, shard_layout: Any) -> bool:
    """True for the strategy form, False for the resolution form; TypeError for a mix."""
    if shard_batch is not None:
        mixed = [n for n, v in (("model", model), ("batch", batch), ("config", config))
                 if v is not None]
        if mixed:
            raise TypeError(
                f"shard_batch (strategy form) is mutually exclusive with the resolution "
                f"arguments model, batch and config; got {', '.join(mixed)} as well"
            )
        return True
    if local_token_global_indices is not None or shard_layout is not None:
        raise TypeError(
            "local_token_global_indices and shard_layout belong to the strategy form and "
            "require shard_batch"
        )
    if batch is not None and not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of tensors, got {type(batch).__name__}")
    return False


def resolution_config(model: Any, config: Any, meshes: Meshes, padding_token_id: int,
                      verify_layout: bool) -> Any:
    """The registry config the resolution form builds: ``config``, else ``model.cp_config``,
    else the framework default (round-robin with CP active, identity without).

    A backend name or a plain mapping gets ``size`` (from the CP mesh), ``padding_token_id``
    and ``verify_layout`` filled in where it does not set them; a validated config object is
    used as it is.
    """
    chosen = config if config is not None else getattr(model, "cp_config", None)
    if chosen is None:
        chosen = "round_robin" if cp_size(meshes.cp_mesh) > 1 else "identity"
    if isinstance(chosen, str):
        chosen = {"backend": chosen}
    if not isinstance(chosen, Mapping):
        return chosen  # a CPBackendConfig or DictConfig: the registry validates it as given
    out = dict(chosen)
    out.setdefault("size", cp_size(meshes.cp_mesh))
    if not _ignores(out.get("backend"), "padding_token_id"):
        # A backend that does not honour the pad token refuses it in its config: the caller's
        # value is not forwarded there (it would not be used either way).
        out.setdefault("padding_token_id", padding_token_id)
    if verify_layout:
        out.setdefault("verify_layout", True)
    return out


def _ignores(backend: Any, field_name: str) -> bool:
    """True when ``backend``'s config model declares ``field_name`` not honoured."""
    from cp_core.errors import CPError
    from cp_core.registry import get_backend

    try:
        model = get_backend(str(backend)).config_model
    except CPError:  # unknown or broken: the registry reports it when building
        return False
    return field_name in getattr(model, "not_honoured", {})


def build_from_registry(config: Any, meshes: Meshes) -> Any:
    """Build the sharder ``config`` names (imported here: the registry imports the sharder)."""
    from cp_core.registry import build_sharder

    return build_sharder(config, meshes.cp_mesh, meshes.tp_mesh)


__all__ = ["Meshes", "meshes_from_args", "check_form", "resolution_config",
           "build_from_registry"]
