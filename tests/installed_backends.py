"""Which CP backends this environment can build, for the cross-package tests.

The tests folder is not a package: a test module loads this file with
``cp_core.testing.multirank.load_module_file(Path(__file__).with_name("installed_backends.py"))``.
A backend that is listed but fails to import is left out here; the registry tests cover that
failure on their own.
"""

from __future__ import annotations

from cp_core.errors import CPError
from cp_core.registry import available_backends, get_backend


def loadable(name: str) -> bool:
    """True when backend ``name`` is installed and imports."""
    if name not in available_backends():
        return False
    try:
        get_backend(name)
    except CPError:
        return False
    return True


def loadable_backends(exclude: tuple[str, ...] = ()) -> list[str]:
    """Installed backends that import, in registry order, without the names in ``exclude``."""
    return [name for name in available_backends() if name not in exclude and loadable(name)]
