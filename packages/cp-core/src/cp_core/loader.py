"""Sharding in data-loader workers: the host work of a shard, off the training thread.

A shard's host work (resolve the documents, place, pad and select, plan the attention) needs
only the full batch, this rank and the CP size. :class:`CPCollator` runs it where the batch is
made, in a ``DataLoader``'s worker processes, for one rank::

    loader = DataLoader(dataset, batch_size=2, num_workers=2,
                        collate_fn=CPCollator(collate, {"backend": "round_robin"}, rank, cp))
    for host in CPLoader(loader):               # received on a background thread
        ctx, local = adopt_shard(sharder, host)   # the training side: no host work left
        with ctx():
            ...

Each item the loader yields is a :class:`HostShard`: the local batch, the layout, the
backend's context factory and its attention plan with the transport's schedule built already
(plain data: tensors, ints, runs; no process group). :func:`adopt_shard` attaches the
training side's mesh (the group is never pickled), runs ``verify_layout``'s collective when
the sharder has it on, and returns ``(ctx, local)`` exactly as ``sharder.shard(batch)``
would: the same local tensors and the same plan, bit for bit. :class:`CPLoader`
(:mod:`cp_core.prefetch`) receives the loader's results on a background thread, so the
training thread's ``next`` is a local queue read, not the worker queue's read and unpickling.

The worker's sharder plans over a :class:`WorkerMesh`, a ``(rank, size)`` stand-in whose
process group is attached on the training side; a collective on it before that raises.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from cp_core.comm.mesh import SimulatedCPMesh, cp_group, cp_rank, cp_size, can_communicate
from cp_core.errors import CPBatchError, CPConfigError, CPError, CPLayoutError
from cp_core.placement.layout import ShardLayout
from cp_core.placement.positions import flat_batch_as_rows
from cp_core.placement.runs import forget_lazy
from cp_core.plan.record import AttentionPlan
from cp_core.prefetch import CPLoader


class WorkerMesh:
    """The CP mesh of a shard made off the training thread: ``rank`` of ``size`` ranks.

    It plans and shards like a :class:`~cp_core.comm.mesh.SimulatedCPMesh`; its process
    group is the one :meth:`attach` gives it on the training side (never pickled: a worker
    has none). A collective before then raises :class:`CPLayoutError`.
    """

    def __init__(self, rank: int, size: int) -> None:
        SimulatedCPMesh(rank, size)  # the same validation, the same errors
        self._rank, self._size = rank, size
        self._attached: Any = None

    def size(self) -> int:
        """Number of CP ranks."""
        return self._size

    def get_local_rank(self) -> int:
        """The rank this shard was made for."""
        return self._rank

    def get_group(self) -> Any:
        """The attached mesh's process group; raises before :meth:`attach`."""
        if self._attached is None:
            raise CPLayoutError(
                f"rank {self._rank} of {self._size}: this shard was made off the training "
                "thread and has no process group yet; hand it to the training loop with "
                "cp_core.loader.adopt_shard(sharder, host_shard) before entering its context")
        return cp_group(self._attached)

    def attach(self, cp_mesh: Any) -> None:
        """Attach the training side's CP mesh (same rank and size, else
        :class:`CPConfigError`)."""
        got = (cp_rank(cp_mesh), cp_size(cp_mesh))
        if got != (self._rank, self._size):
            raise CPConfigError(
                f"the shard was made for rank {self._rank} of {self._size}, but the sharder it "
                f"is handed to is rank {got[0]} of {got[1]}: give each rank's CPCollator that "
                "rank's cp_rank and the CP size of its mesh")
        self._attached = cp_mesh

    def __getstate__(self) -> dict[str, Any]:
        # A process group never travels: the receiving side attaches its own.
        return {"_rank": self._rank, "_size": self._size, "_attached": None}

    def __repr__(self) -> str:
        return f"WorkerMesh(rank={self._rank}, size={self._size})"


@dataclass
class HostShard:
    """One rank's shard of one batch, made on the host (picklable plain data).

    ``local``: the local batch, as ``sharder.shard`` returns it. ``layout``: its
    :class:`ShardLayout`. ``factory``: the backend's context factory (None when the backend
    has no attention work). ``plan``: the attention plan that factory activates, its
    transport schedule built (None without one). ``check``: ``verify_layout``'s local vector
    (None when the check is off). ``mesh``: the :class:`WorkerMesh` the plan refers to.
    ``error``: set instead of the rest when the shard failed.
    """

    local: dict[str, Any]
    layout: ShardLayout | None
    factory: Callable[..., Any] | None
    plan: AttentionPlan | None
    mesh: WorkerMesh
    check: torch.Tensor | None = None
    error: BaseException | None = None
    """The error the shard raised in the worker (``adopt_shard`` re-raises it after telling
    the peers, so they name this rank instead of waiting for the group's timeout)."""

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Leaving a worker, the shard travels as one blob with its tensors inline: one pipe
        # read on the training thread instead of a shared-memory handle (file descriptor,
        # mapping, and its release) per tensor, most of which are a few kilobytes.
        # Every rank's indices, when the runs give them, are expanded again only if read.
        if self.layout is not None and self.layout.rank_runs is not None:
            forget_lazy(self.layout, "rank_global_indices")
        if self.plan is not None and self.plan.rank_runs is not None:
            forget_lazy(self.plan, "rank_indices")
        return _unpack, (_pack(self.__dict__),)

    def pin_memory(self) -> "HostShard":
        """Pin the local batch's tensors (``DataLoader(pin_memory=True)`` calls this)."""
        self.local = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                      for k, v in self.local.items()}
        return self


class _SkipTensors(pickle.Pickler):
    """Pickles everything but tensors (they travel through shared memory anyway): what is
    left is what could fail to pickle."""

    def persistent_id(self, obj: Any) -> Any:
        return "tensor" if isinstance(obj, torch.Tensor) else None


def check_picklable(host: HostShard, backend: str = "the backend") -> None:
    """Raise :class:`CPConfigError` when ``host`` would not pickle (a closure or lambda in a
    backend's result). A data-loader worker pickles its results in a background thread, where
    a failure is only printed and the training loop would wait for the batch forever."""
    try:
        _SkipTensors(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(host)
    except Exception as exc:
        raise CPConfigError(
            f"the shard {backend} made does not pickle ({type(exc).__name__}: {exc}), so it "
            "cannot leave a data-loader worker: what shard_batch returns must be records, not "
            "closures (docs/plugins.md); shard in the step (sharder.shard) instead") from exc


class _InlineTensors(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays (raw bytes), each once however often it is
    referenced; a tensor numpy cannot hold (bfloat16, a device tensor, one that requires
    grad) is pickled as usual."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._seen: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # ids stay unique while the blob is written

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or type(obj) is not torch.Tensor:
            return None
        if id(obj) in self._seen:
            return ("again", self._seen[id(obj)])
        if obj.device.type != "cpu" or obj.requires_grad or obj.dtype == torch.bfloat16 \
                or obj.is_sparse:
            return None
        self._seen[id(obj)] = len(self._keep)
        self._keep.append(obj)
        return ("tensor", obj.numpy())


class _Restore(pickle.Unpickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._made: list[torch.Tensor] = []

    def persistent_load(self, pid: Any) -> Any:
        kind, value = pid
        if kind == "again":
            return self._made[value]
        tensor = torch.from_numpy(value)
        self._made.append(tensor)
        return tensor


def _pack(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    _InlineTensors(buf).dump(state)
    return buf.getvalue()


def _unpack(blob: bytes) -> HostShard:
    host = HostShard.__new__(HostShard)
    host.__dict__.update(_Restore(io.BytesIO(blob)).load())
    return host


def shard_on_host(sharder: Any, batch: Mapping[str, Any], *,
                  loss_mask: torch.Tensor | None = None) -> HostShard:
    """The host work of ``sharder.shard(batch)`` for the rank of ``sharder.cp_mesh`` (a
    :class:`WorkerMesh`): shard, plan, and build the transport's schedule (the context is
    entered once here, as the training step would, so the schedule is cached on the plan)."""
    from cp_core.placement.verify import local_vector
    from cp_core.runtime.intercept import active_plan

    mesh = sharder.cp_mesh
    if not isinstance(mesh, WorkerMesh):
        raise CPConfigError(
            f"shard_on_host needs a sharder built over a WorkerMesh (CPCollator builds one); "
            f"got a sharder over {type(mesh).__name__}")
    if loss_mask is None:
        loss_mask = sharder.loss_mask
    factory, out, layout = sharder.shard_batch(
        mesh, sharder.tp_mesh, batch, loss_mask=loss_mask,
        padding_token_id=sharder.padding_token_id)
    if sharder.rows and layout is not None and layout.input_row_shape is not None:
        out = flat_batch_as_rows(out, layout.num_local_tokens)
    plan = None
    if factory is contextlib.nullcontext:
        factory = None
    else:
        with factory():  # the transport's prepare hook runs here: its schedule is host data
            plan = active_plan()
    check = None
    if sharder.verify_layout and cp_size(mesh) > 1:
        check = local_vector(cp_rank(mesh), batch, layout if layout is not None
                             else ShardLayout())
    return HostShard(local=out, layout=layout, factory=factory, plan=plan, mesh=mesh,
                     check=check)


def adopt_shard(sharder: Any, host: HostShard) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(ctx, local)`` of a shard made off the training thread, exactly as
    ``sharder.shard(batch)`` would return them: the shard's mesh gets ``sharder.cp_mesh``'s
    group, ``verify_layout``'s collective runs when the sharder has it on, and the step is
    the sharder's (its token verbs, ``ctx.layout``, ``sharder.shard_layout``)."""
    from cp_core.comm.failures import recording_ctx
    from cp_core.placement.verify import exchange_vectors

    if not isinstance(host, HostShard):
        raise CPBatchError(
            f"adopt_shard takes what a CPCollator-driven DataLoader yields (a HostShard), got "
            f"{type(host).__name__}; is the loader's collate_fn a cp_core.loader.CPCollator?")
    host.mesh.attach(sharder.cp_mesh)
    if host.error is not None:
        if sharder.verify_layout and can_communicate(sharder.cp_mesh) and host.check is not None:
            exchange_vectors(sharder.cp_mesh, host.check, None, failed=True)
        raise host.error
    if sharder.verify_layout and can_communicate(sharder.cp_mesh):
        if host.check is None:
            raise CPConfigError(
                "the sharder has verify_layout on but the shard was made without its check: "
                "give the CPCollator the same config (verify_layout) as the sharder")
        padded = host.layout.padded_seq_len if host.layout is not None else None
        exchange_vectors(sharder.cp_mesh, host.check, padded)
    # The end of sharder.shard, on the training side.
    sharder.shard_layout = host.layout
    factory = host.factory if host.factory is not None else contextlib.nullcontext
    if factory is not contextlib.nullcontext and can_communicate(sharder.cp_mesh):
        factory = recording_ctx(factory)  # an error in the step names this rank
    return sharder._tracker().record(factory, sharder, host.layout, host.local), host.local


class CPCollator:
    """A ``collate_fn`` that shards each collated batch for one CP rank, in the loader's
    worker processes (see the module docstring).

    Args:
        collate_fn: makes the full batch from the samples (None: torch's default collate).
        config: the backend config, as for :func:`cp_core.registry.build_sharder` (a mapping
            or the backend's validated config); the training side's sharder must have the
            same.
        rank: this process's CP rank. cp_size: the CP size.
        tp_size: the tensor-parallel size (for ``sequence_parallel`` pad multiples).
        loss_mask_key: a batch key whose tensor is passed as ``shard(..., loss_mask=)``.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Mapping[str, Any]] | None,
                 config: Any, rank: int, cp_size: int, *, tp_size: int = 1,
                 loss_mask_key: str | None = None) -> None:
        from cp_core.registry import resolve_config

        SimulatedCPMesh(rank, cp_size)  # rank and size are checked here, not in a worker
        resolve_config(config)  # a bad config fails where it is written, not in a worker
        self.collate_fn = collate_fn
        self.config = config
        self.rank, self.cp_size, self.tp_size = rank, cp_size, tp_size
        self.loss_mask_key = loss_mask_key
        self._sharder: Any = None

    def sharder(self) -> Any:
        """This process's sharder over a :class:`WorkerMesh` (built once per process)."""
        if self._sharder is None:
            from cp_core.registry import build_sharder

            tp = SimulatedCPMesh(0, self.tp_size) if self.tp_size > 1 else None
            self._sharder = build_sharder(self.config, WorkerMesh(self.rank, self.cp_size), tp)
        return self._sharder

    def __call__(self, samples: list[Any]) -> HostShard:
        """Collate ``samples`` and shard the batch for this rank."""
        if self.collate_fn is None:
            from torch.utils.data import default_collate

            batch = default_collate(samples)
        else:
            batch = self.collate_fn(samples)
        if not isinstance(batch, Mapping):
            raise CPBatchError(f"the collate_fn returned {type(batch).__name__}; a CP shard "
                               "needs a mapping of batch keys (input_ids, labels, ...)")
        loss_mask = None
        if self.loss_mask_key is not None:
            batch = dict(batch)
            loss_mask = batch.pop(self.loss_mask_key)
        sharder = self.sharder()
        try:
            host = shard_on_host(sharder, batch, loss_mask=loss_mask)
        except CPError as exc:
            # The training side re-raises it after the verify exchange (the peers then name
            # this rank at once); any other error is a bug and leaves the worker as it is.
            return self._failed(sharder, batch, exc)
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:  # it is about to be pickled: fail here, loudly
            check_picklable(host, f"backend {self._backend_name()!r}")
        return host

    def _failed(self, sharder: Any, batch: Mapping[str, Any], exc: CPError) -> HostShard:
        from cp_core.placement.verify import local_vector

        check = None
        if sharder.verify_layout and self.cp_size > 1:
            check = local_vector(self.rank, batch, ShardLayout(), failed=True)
        exc.__traceback__ = None  # frames do not pickle; the message names the cause
        host = HostShard(local={}, layout=None, factory=None, plan=None,
                         mesh=sharder.cp_mesh, check=check, error=exc)
        try:
            check_picklable(host)
        except CPConfigError:
            raise exc from None  # the loader re-raises it in the training loop as it is
        return host

    def _backend_name(self) -> str:
        config = self.config
        name = config.get("backend") if isinstance(config, Mapping) else getattr(
            config, "backend", None)
        return str(name)

    def __getstate__(self) -> dict[str, Any]:
        # Each worker builds its own sharder (and its caches) from the config.
        state = dict(self.__dict__)
        state["_sharder"] = None
        return state


__all__ = ["CPCollator", "CPLoader", "HostShard", "WorkerMesh", "adopt_shard", "check_picklable",
           "shard_on_host"]
