#!/usr/bin/env python
"""The main job: a short CP training run of the reference decoder on CPU (gloo).

    .venv/bin/python tools/demo.py cp=round_robin cp.size=4

Hydra overrides select and parameterize the backend (``cp=<name> cp.<key>=<value>``) and the
run (``demo.steps=4 demo.seq_len=2048``). The script re-launches itself under ``torchrun``
with ``cp.size`` ranks; see :mod:`cp_core.cli.demo`.
"""

import sys

from cp_core.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
