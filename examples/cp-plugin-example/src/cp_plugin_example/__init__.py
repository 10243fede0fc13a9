"""cp_plugin_example: a third-party cp-core backend (the ``striped`` layout).

Importing this package registers nothing: cp-core discovers the backend through the
``cp_core.backends`` entry point declared in this distribution's ``pyproject.toml``.
"""

from cp_plugin_example.layout import striped_local_indices

__all__ = ["striped_local_indices"]
