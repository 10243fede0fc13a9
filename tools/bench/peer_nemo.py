"""Peer: NeMo AutoModel's ``ContextParallelSharder``, round-robin and contiguous paths.

Runs in the NeMo AutoModel virtual environment (see ``peer_env.py``). A CPU DeviceMesh over a
fake process group of ``--cp`` ranks stands in for the CP mesh, with this process as
``--rank``.

* ``nemo_round_robin``: the sharder resolved by the public constructor
  (``ContextParallelSharder(None, device_mesh, batch, loss_mask=...)``, model-less, CP
  active -> torch ``context_parallel`` load balancing). Its ``shard`` only pads; the tensors
  are sharded in place when the returned context is entered (and ``position_ids`` restored
  on exit), so the timed region is ``shard`` plus entering and leaving that context.
* ``nemo_contiguous``: a sharder over NeMo's ``shard_batch_contiguous`` (the model-owned
  contiguous path), timed over ``shard`` plus its (null) context.

NeMo takes the loss mask as a sharder argument and mutates the tensors it is given, so every
run gets fresh copies (untimed) and a new sharder (untimed).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from peer_common import init_fake_group, parse_args, run_cases


def main() -> None:
    """Time both real paths; print the JSON result line."""
    args = parse_args(["nemo_round_robin", "nemo_contiguous"])
    init_fake_group(args.rank, args.cp)
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_automodel.components.distributed.context_parallel.sharder import (
        ContextParallelSharder,
        contiguous_local_indices,
        shard_batch_contiguous,
    )

    mesh = init_device_mesh("cpu", (args.cp,), mesh_dim_names=("cp",))

    def prepare_rr(batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        loss_mask = batch.pop("loss_mask")
        return ContextParallelSharder(None, mesh, batch, loss_mask=loss_mask), batch

    def prepare_contig(batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        loss_mask = batch.pop("loss_mask")
        sharder = ContextParallelSharder(
            device_mesh=mesh, shard_batch=shard_batch_contiguous,
            local_token_global_indices=contiguous_local_indices, loss_mask=loss_mask,
        )
        return sharder, batch

    def shard(arg: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
        sharder, batch = arg
        ctx_factory, out = sharder.shard(batch)
        with ctx_factory():
            # Inside the context the round-robin buffers are sharded (a forward would run
            # here); snapshot what the model sees before leaving restores any of them.
            seen = dict(out)
        return seen

    run_cases(args, {"nemo_round_robin": (prepare_rr, shard),
                     "nemo_contiguous": (prepare_contig, shard)},
              {"peer": "nemo-automodel", "version": version("nemo-automodel")})


if __name__ == "__main__":
    main()
