#!/usr/bin/env python
"""The main job: a short CP training run of the reference decoder on CPU (gloo).

    .venv/bin/python tools/demo.py cp=round_robin cp.size=4

The same Hydra app as ``cp-demo`` (see :mod:`cp_core.cli.demo`): ``cp=<name> cp.<key>=<value>``
select and parameterize the backend, ``demo.steps=4 demo.seq_len=2048`` the run; ``--help``,
``--cfg job`` and ``-m`` work as in any Hydra app. It starts ``cp.size`` gloo processes with
torch's elastic launcher.
"""

import sys

from cp_core.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
