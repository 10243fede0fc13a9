"""Peer: Megatron-Core's ``get_batch_on_this_cp_rank`` (head-tail split), timed on the batch spec.

Runs in the Megatron-Core virtual environment (see ``peer_env.py``). The function reads the
CP size and rank from the ``cp_group`` it is given: a fake process group of ``--cp`` ranks in
which this process is ``--rank``. Megatron takes the loss mask as a batch key and needs the
sequence already divisible by ``2*cp`` (the benchmark shapes are).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from peer_common import init_fake_group, parse_args, run_cases


def main() -> None:
    """Time the real function; print the JSON result line."""
    args = parse_args(["megatron_head_tail"])
    init_fake_group(args.rank, args.cp)
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = dist.group.WORLD

    def prepare(batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def shard(batch: dict[str, Any]) -> dict[str, Any]:
        return get_batch_on_this_cp_rank(batch, cp_group=group)

    run_cases(args, {"megatron_head_tail": (prepare, shard)},
              {"peer": "megatron-core", "version": version("megatron-core")})


if __name__ == "__main__":
    main()
