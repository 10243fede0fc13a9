"""``--help`` of cp-core's Hydra apps, written from the pydantic field docs.

Hydra prints the ``hydra/help`` config of the app; this module builds that text (the app, its
flags, every installed backend (only the selected ones are imported and described; the
others by entry-point name), every key with its one-line doc and default) and stores it as a
``hydra/help`` node. Hydra appends the composed config, so ``cp-plan cp=magi --help`` also
shows magi's values with the user's overrides applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

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


def _load(selected: Sequence[str] | None) -> tuple[dict[str, Any], dict[str, Exception]]:
    """The backends to describe: ``selected`` only (None: every installed one)."""
    registry = default_registry()
    if selected is None:
        return registry.load_all()
    loaded, errors = {}, {}
    for name in selected:
        try:
            loaded[name] = registry.get(name)
        except Exception as exc:  # reported in the listing, never hidden
            errors[name] = exc
    return loaded, errors


def help_text(spec: AppSpec, selected: Sequence[str] | None = None) -> str:
    """The whole ``--help`` text of ``spec`` (before Hydra substitutes ``$CONFIG``).

    ``selected``: the backends chosen on the command line, described in full; the other
    installed ones are listed by entry-point name and never imported."""
    from cp_core.cli.app import APP_DEFAULT_CP_SIZE

    loaded, errors = _load(selected)
    others = [n for n in default_registry().available() if n not in loaded and n not in errors]
    sections = " ".join(f"{name}.<key>=<value>" for name in spec.sections)
    lines = [f"{spec.prog}: {spec.summary}", "",
             f"usage: {spec.prog} [cp=<backend>] [cp.<key>=<value>] [{sections}] [flags]", "",
             "flags:"]
    width = max(len(f) for f, _ in (*spec.flags, *HYDRA_FLAGS))
    lines += [f"  {flag:<{width}}  {text}" for flag, text in (*spec.flags, *HYDRA_FLAGS)]
    lines += ["", f"backends (cp=<name>, default {spec.default_backend}; every installed one):"]
    lines += [f"  {name:<12} {' '.join(b.description.split())}" for name, b in loaded.items()]
    lines += [f"  {name:<12} installed but failed to load: {exc}" for name, exc in errors.items()]
    if others:
        lines += [f"  {name:<12} (not imported; cp={name} --help describes it)" for name in others]
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


def store_help(spec: AppSpec, selected: Sequence[str] | None = None) -> str:
    """Store the help of ``spec`` (describing ``selected``) as a ``hydra/help`` option; returns
    the option's name."""
    from hydra.core.config_store import ConfigStore

    name = spec.config_name
    node: dict[str, Any] = {"app_name": spec.prog, "header": "", "footer": "",
                            "template": help_text(spec, selected)}
    ConfigStore.instance().store(group="hydra/help", name=name, node=node, provider="cp_core")
    return name


__all__ = ["help_text", "store_help", "key_lines", "HYDRA_FLAGS"]
