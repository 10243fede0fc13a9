"""``--help`` of cp-core's Hydra apps, written from the pydantic field docs.

Hydra prints the ``hydra/help`` config of the app; this module builds that text (the app, its
flags, every installed backend, every key with its one-line doc and default) and stores it as a
``hydra/help`` node. Hydra appends the composed config, so ``cp-plan cp=magi --help`` also
shows magi's values with the user's overrides applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from pydantic import BaseModel

from cp_core.config import CPBackendConfig
from cp_core.registry import default_registry

if TYPE_CHECKING:
    from cp_core.cli.app import AppSpec

#: Flags every app understands (Hydra's own).
HYDRA_FLAGS = (
    ("--cfg job", "print the composed config (with your overrides) and exit"),
    ("-m, --multirun", "sweep: -m cp=round_robin,magi cp.size=2,4 runs every combination"),
    ("--info", "Hydra's view of the search path and defaults"),
    ("--hydra-help", "Hydra's own options (hydra.run.dir=..., hydra/launcher=...)"),
)


def _doc(model: type[BaseModel], name: str) -> str:
    info = model.model_fields[name]
    text = " ".join((info.description or "").split())
    return text


def _default(model: type[BaseModel], name: str) -> str:
    info = model.model_fields[name]
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def key_lines(prefix: str, model: type[BaseModel], names: Iterable[str]) -> list[str]:
    """``  prefix.key (default): doc`` for every name, one line each."""
    lines = []
    for name in names:
        lines.append(f"  {prefix}.{name} ({_default(model, name)}): {_doc(model, name)}")
    return lines


def help_text(spec: AppSpec) -> str:
    """The whole ``--help`` text of ``spec`` (before Hydra substitutes ``$CONFIG``)."""
    from cp_core.cli.app import APP_DEFAULT_CP_SIZE

    registry = default_registry()
    loaded, errors = registry.load_all()
    sections = " ".join(f"{name}.<key>=<value>" for name in spec.sections)
    lines = [f"{spec.prog}: {spec.summary}", "",
             f"usage: {spec.prog} [cp=<backend>] [cp.<key>=<value>] [{sections}] [flags]", "",
             "flags:"]
    width = max(len(f) for f, _ in (*spec.flags, *HYDRA_FLAGS))
    lines += [f"  {flag:<{width}}  {text}" for flag, text in (*spec.flags, *HYDRA_FLAGS)]
    lines += ["", f"backends (cp=<name>, default {spec.default_backend}; every installed one):"]
    lines += [f"  {name:<12} {' '.join(b.description.split())}" for name, b in loaded.items()]
    lines += [f"  {name:<12} installed but failed to load: {exc}" for name, exc in errors.items()]
    common = list(CPBackendConfig.model_fields)
    lines += ["", f"cp.<key>, every backend (cp.size unset: {APP_DEFAULT_CP_SIZE} ranks here; in "
              "build_sharder the mesh's size):"]
    lines += key_lines("cp", CPBackendConfig, common)
    for name, backend in loaded.items():
        own = [k for k in backend.config_model.model_fields if k not in common]
        if own:
            lines += ["", f"cp.<key> of {name} only:"]
            lines += key_lines("cp", backend.config_model, own)
    for name, model in spec.sections.items():
        lines += ["", f"{name}.<key>:"]
        lines += key_lines(name, model, model.model_fields)
    # string.Template runs over the text: a literal dollar is written twice.
    body = "\n".join(lines).replace("$", "$$")
    return body + "\n\ncomposed config (with your overrides):\n\n$CONFIG\n"


def store_help(spec: AppSpec) -> str:
    """Store the help of ``spec`` as a ``hydra/help`` option; returns the option's name."""
    from hydra.core.config_store import ConfigStore

    name = spec.config_name
    node: dict[str, Any] = {"app_name": spec.prog, "header": "", "footer": "",
                            "template": help_text(spec)}
    ConfigStore.instance().store(group="hydra/help", name=name, node=node, provider="cp_core")
    return name


__all__ = ["help_text", "store_help", "key_lines", "HYDRA_FLAGS"]
