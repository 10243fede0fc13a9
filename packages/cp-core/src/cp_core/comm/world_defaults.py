"""Keep torch's import-time defaults from holding the default process group past its end.

``torch.distributed.nn.functional`` declares its collectives with ``group=group.WORLD`` as a
default argument. That default is evaluated when the module is first imported: imported before
``init_process_group`` it is None (the functions then use whatever group is the default when
they are called); imported after, it is the live default group object, held by ten function
signatures for the rest of the process.

torch imports that module lazily, and ordinary training code triggers it after
``init_process_group``: the first ``torch.optim.AdamW(...)`` (and other optimizers) imports
``torch._dynamo``, which pulls in ``torch.distributed.fsdp`` and ``torch.distributed._shard``,
which imports ``torch.distributed.nn``. From then on ``destroy_process_group()`` cannot free the
default group: its gloo worker threads keep running until the interpreter's own teardown
destroys the module. A worker still releasing a finished collective's tensors at that moment
(an all-reduce of ``p.grad`` followed by ``zero_grad()``, whose Python tensor objects the work
then owns) must take the GIL after finalization has begun; Python ends such a thread with
``pthread_exit`` inside a C++ destructor, and the process aborts with "terminate called without
an active exception" after a script that finished normally.

Importing the module here, when ``cp_core`` is imported and no process group exists yet, binds
those defaults to None, so the default group is freed by ``destroy_process_group()`` and its
threads are joined while the interpreter is whole.
"""

from __future__ import annotations

import importlib
import sys

#: The torch module whose signatures capture ``group.WORLD`` when it is imported.
_CAPTURING_MODULE = "torch.distributed.nn.functional"


def bind_world_defaults_early() -> None:
    """Import :data:`_CAPTURING_MODULE` now if no default process group exists yet, so that
    its ``group`` defaults are None (see the module docstring).

    With a default group already initialized the import is skipped: it would bind that group
    into the signatures at once, the very thing this avoids. Never raises (a torch without
    distributed support or without that module has nothing to bind)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and not dist.is_initialized():
            importlib.import_module(_CAPTURING_MODULE)
    except Exception:  # noqa: BLE001 - a torch without the module has no defaults to bind
        pass


def pinned_groups() -> int:
    """How many default arguments of :data:`_CAPTURING_MODULE`'s functions hold a process
    group object (0 when the module is not imported): each keeps that group alive."""
    module = sys.modules.get(_CAPTURING_MODULE)
    if module is None:
        return 0
    import torch.distributed as dist

    return sum(isinstance(d, dist.ProcessGroup)
               for f in vars(module).values() if callable(f)
               for d in (getattr(f, "__defaults__", None) or ()))


def gloo_worker_threads() -> int | None:
    """How many gloo worker threads (``pt_gloo_runloop``) this process runs now: a process
    group not yet freed runs some. None where thread names cannot be read (only Linux's
    ``/proc/self/task`` is)."""
    import os

    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    names = []
    for t in os.listdir(tasks):
        with open(f"{tasks}/{t}/comm") as f:
            names.append(f.read().strip())
    return names.count("pt_gloo_runloop")


__all__ = ["bind_world_defaults_early", "pinned_groups", "gloo_worker_threads"]
