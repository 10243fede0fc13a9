"""Command-line tools of cp_core: ``cp-plan`` and ``cp-demo``."""
