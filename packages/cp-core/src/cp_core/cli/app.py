"""What cp-core's Hydra apps share: the command-line check, one-line errors, the Hydra run.

A user error on the command line (an unknown backend, key or value, a value the backend's
pydantic model refuses) is reported as **one line naming the key and the fix, exit code 2**,
before any work or process starts. Anything else is a bug and keeps its traceback.

The check runs before Hydra: it parses the overrides with Hydra's own grammar, checks
``cp=<name>`` against the registry (an uninstalled known backend gives its ``pip install``
line), ``cp.<key>`` against the chosen backends' models and ``<section>.<key>`` against the
app's section models; for a single run it then composes the config and validates it as the
job will. Jobs of a multirun are validated again inside the job (the guard below).
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pydantic import BaseModel, ValidationError

from cp_core.errors import CPBackendLoadError, CPBackendNotFoundError, CPBatchError, CPConfigError
from cp_core.hydra_config import (CONFIG_PATH, CP_GROUP, compose_app_config, only_backends,
                                  register_backend_configs)
from cp_core.registry import Registry, default_registry

#: CP size of the apps when ``cp.size`` is unset (no mesh exists yet to take it from).
APP_DEFAULT_CP_SIZE = 2

#: Errors that are the user's: reported in one line with exit code 2 (the rest keep tracebacks).
#: A selected plugin that fails to import is the installation's problem, not a bug of the app:
#: one line naming the plugin and its error.
USER_ERRORS: tuple[type[BaseException], ...] = (CPConfigError, CPBackendNotFoundError,
                                                CPBackendLoadError, CPBatchError)


class CLIUsageError(Exception):
    """A command-line mistake: the message is one line naming the key and the fix."""


@dataclass(frozen=True)
class AppSpec:
    """One Hydra app of cp-core.

    Attributes:
        prog: the command's name (``cp-plan``), the prefix of every error line.
        config_name: the shipped primary config (``cp_core/conf/<config_name>.yaml``).
        sections: the app's own config sections and the pydantic models that validate them.
        summary: what the app does, the first paragraph of ``--help``.
        flags: extra ``(flag, help)`` lines of ``--help`` (beyond Hydra's own).
        default_backend: the ``cp`` choice of the primary config.
        validate: extra validation of a composed config (a single run only), raising user errors.
    """

    prog: str
    config_name: str
    sections: Mapping[str, type[BaseModel]]
    summary: str
    flags: Sequence[tuple[str, str]] = ()
    default_backend: str = "round_robin"
    validate: Callable[[Mapping[str, Any]], None] | None = field(default=None)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (Hydra messages span several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def _did_you_mean(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def with_app_cp_size(cp: Mapping[str, Any]) -> dict[str, Any]:
    """The ``cp`` section with ``size`` filled in when unset: the apps simulate or start that
    many ranks (a backend limited to one size, identity, carries it as its default)."""
    data = dict(cp)
    if data.get("size") is None:
        data["size"] = APP_DEFAULT_CP_SIZE
    return data


def _choices(override: Any) -> list[str]:
    """Every value of an override: one, or each of a sweep (``cp=a,b``)."""
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    return [str(override.value())]


def check_overrides(spec: AppSpec, overrides: Sequence[str],
                    registry: Registry | None = None) -> list[str]:
    """Raise :class:`CLIUsageError` for an override that cannot be right (see module doc).

    Returns the selected backends (``cp=<name>``, each of a sweep, else the app's default):
    the only ones imported."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    registry = registry or default_registry()
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:  # the grammar's errors (OverrideParseException and others)
            first = str(exc).splitlines()[0] if str(exc) else "syntax error"
            raise CLIUsageError(f"cannot parse the override {text!r}: {first}; write key=value "
                                "(quote lists, e.g. 'plan.docs=[300,200]')") from None
    backends = [spec.default_backend]
    for ov in parsed:
        if ov.key_or_group == CP_GROUP and not ov.is_delete():
            backends = _choices(ov)
            for name in backends:
                if name not in registry.available():
                    try:
                        registry.get(name)
                    except CPBackendNotFoundError as exc:
                        raise CLIUsageError(f"cp={name}: {one_line(exc)}") from None
    models = {name: registry.get(name).config_model for name in backends}
    top_level = sorted({CP_GROUP, *spec.sections})
    for ov in parsed:
        key = ov.key_or_group
        head, _, rest = key.partition(".")
        if head == "hydra" or ov.is_delete() or not rest and head in top_level:
            continue
        if head not in top_level:
            keys = ", ".join(f"{k}.<key>" for k in top_level)
            raise CLIUsageError(f"unknown key {key!r}{_did_you_mean(head, top_level)}; this app "
                                f"takes {keys} (and hydra.<key>)")
        sub = rest.split(".")[0]
        if head == CP_GROUP:
            for name, model in models.items():
                if sub not in model.model_fields:
                    valid = sorted(model.model_fields)
                    raise CLIUsageError(
                        f"unknown key cp.{sub} for CP backend {name!r}"
                        f"{_did_you_mean(sub, valid)}; valid keys: {', '.join(valid)}")
        else:
            valid = sorted(spec.sections[head].model_fields)
            if sub not in valid:
                raise CLIUsageError(f"unknown key {head}.{sub}{_did_you_mean(sub, valid)}; "
                                    f"valid keys: {', '.join(valid)}")
    return backends


def validate_section(name: str, model: type[BaseModel], values: Any) -> BaseModel:
    """Validate one app section, raising :class:`CPConfigError` naming ``<name>.<key>``."""
    try:
        return model.model_validate(dict(values or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or name
            problems.append(f"{name}.{key}: {err['msg']} (got {err.get('input')!r})")
        raise CPConfigError(f"invalid {name} configuration: " + "; ".join(problems)) from None


def validate_config(spec: AppSpec, data: Mapping[str, Any]) -> None:
    """Everything a job checks before work: the CP config by its backend's model (with the
    app's CP size), each section by its model, then the app's own checks."""
    from cp_core.registry import resolve_config

    resolve_config(with_app_cp_size(data.get(CP_GROUP) or {}))
    for name, model in spec.sections.items():
        validate_section(name, model, data.get(name))
    if spec.validate is not None:
        spec.validate(data)


def _report(spec: AppSpec, exc: BaseException) -> int:
    print(f"{spec.prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
    return 2


def guard(spec: AppSpec, task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``task`` with user errors turned into one line and exit code 2 (multirun jobs too).

    SystemExit is not an ``Exception``, so Hydra's job runner lets it through unchanged."""

    def guarded(cfg: Any) -> Any:
        try:
            return task(cfg)
        except (CLIUsageError, *USER_ERRORS) as exc:
            raise SystemExit(_report(spec, exc)) from None

    guarded.__doc__ = task.__doc__
    return guarded


def _hydra_args(argv: Sequence[str]) -> Any:
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(list(argv))


def run_app(spec: AppSpec, task: Callable[[Any], Any], argv: Sequence[str]) -> int:
    """Check the command line, then run ``task`` as the Hydra app ``spec``; the exit code."""
    args = _hydra_args(argv)  # argparse itself exits 2 on an unknown flag
    argv = list(argv)
    try:
        selected = check_overrides(spec, args.overrides)
    except (CLIUsageError, *USER_ERRORS) as exc:
        return _report(spec, exc)
    # Only the selected backends are imported (here and by the search-path plugin inside
    # hydra.main): an unselected plugin's import-time code never runs.
    with only_backends(selected):
        return _run_selected(spec, task, args, argv, selected)


def _run_selected(spec: AppSpec, task: Callable[[Any], Any], args: Any, argv: list[str],
                  selected: Sequence[str]) -> int:
    import hydra
    from omegaconf import OmegaConf

    register_backend_configs()
    try:
        just_show = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
        if not args.multirun and not just_show:
            try:
                cfg = compose_app_config(spec.config_name,
                                         [o for o in args.overrides if not o.startswith("hydra")])
            except Exception as exc:  # Hydra's composition errors are about the command line
                raise CLIUsageError(one_line(exc)) from None
            data = OmegaConf.to_container(cfg, resolve=True)
            assert isinstance(data, dict)
            validate_config(spec, data)
    except (CLIUsageError, *USER_ERRORS) as exc:
        return _report(spec, exc)
    if args.help:
        from cp_core.cli.help import store_help

        # Before any flag: argparse wants it so.
        argv.insert(0, f"hydra/help={store_help(spec, selected)}")
    saved, sys.argv = sys.argv, [spec.prog, *argv]  # hydra.main reads the command line there
    try:
        hydra.main(version_base=None, config_path=CONFIG_PATH,
                   config_name=spec.config_name)(guard(spec, task))()
    finally:
        sys.argv = saved
    return 0


__all__ = ["AppSpec", "CLIUsageError", "APP_DEFAULT_CP_SIZE", "USER_ERRORS", "check_overrides",
           "validate_config", "validate_section", "with_app_cp_size", "guard", "run_app",
           "one_line"]
