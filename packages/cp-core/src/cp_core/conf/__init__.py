"""Hydra configs shipped with cp-core (``pkg://cp_core.conf``): the primary configs of
``cp-plan`` and ``cp-demo``. The ``cp`` group is built from the installed backends; see
:mod:`cp_core.hydra_config`."""
