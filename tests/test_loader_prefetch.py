"""CPLoader (cp_core.prefetch): a loader's batches received on a background thread.

The batches and plans it hands over are compared bit for bit with sharding in the step
(``sharder.shard``), for ``num_workers`` 0 and 2 and ``persistent_workers``; its order is the
dataset's; a worker's exception reaches the training loop with its original message; and the
receiver thread is gone after the pass ends, breaks, is deleted or the step raises, and at
interpreter exit without any of these.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_loader import _batches, _compare, _first, _in_step  # noqa: E402

from cp_core.comm.mesh import SimulatedCPMesh  # noqa: E402
from cp_core.loader import CPCollator, CPLoader, HostShard, adopt_shard  # noqa: E402
from cp_core.registry import build_sharder  # noqa: E402

RECEIVER = "cp-loader-receiver"
#: forkserver workers (this test process has threads: a fork could copy a held lock); the
#: timeout turns a hang into a failure, far above any loaded machine's wait.
MP = {"multiprocessing_context": "forkserver", "timeout": 600}


def receivers() -> int:
    """Receiver threads alive in this process."""
    return sum(t.name == RECEIVER for t in threading.enumerate())


class Numbered(Dataset):
    """Item ``i`` is ``{"i": tensor([i])}``; item ``fail_at`` raises ValueError."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is unreadable (a bad record)")
        return {"i": torch.tensor([i])}


def _numbers(items: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(x["i"]) for x in items]


def _loader(workers: int, **kw: Any) -> DataLoader:
    return DataLoader(Numbered(**kw), batch_size=1, num_workers=workers,
                      **(MP if workers else {}))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", ["round_robin", "aux_only", "te_thd", "magi"])
def test_prefetched_shard_is_the_step_shard(name: str, workers: int) -> None:
    config = {"backend": name, "verify_layout": True}
    batches = _batches()
    loader = DataLoader(batches, batch_size=1, num_workers=workers,
                        collate_fn=CPCollator(_first, config, 1, 2), **(MP if workers else {}))
    trainer = build_sharder(config, SimulatedCPMesh(1, 2))
    reference = build_sharder(config, SimulatedCPMesh(1, 2))
    seen = 0
    for batch, host in zip(batches, CPLoader(loader), strict=True):
        assert isinstance(host, HostShard)
        _compare(_in_step(reference, batch), adopt_shard(trainer, host), host)
        seen += 1
    assert seen == len(batches)
    assert receivers() == 0


def test_persistent_workers_two_epochs_and_a_break_between() -> None:
    config = {"backend": "magi"}
    batches = _batches() * 2
    loader = DataLoader(batches, batch_size=1, num_workers=2, persistent_workers=True,
                        collate_fn=CPCollator(_first, config, 0, 2), **MP)
    wrapped = CPLoader(loader)
    trainer = build_sharder(config, SimulatedCPMesh(0, 2))
    reference = build_sharder(config, SimulatedCPMesh(0, 2))
    for host in wrapped:  # an epoch left after its first batch
        _compare(_in_step(reference, batches[0]), adopt_shard(trainer, host), host)
        break
    assert receivers() == 0
    for _ in range(2):  # then whole epochs on the same workers, from the start each time
        got = list(wrapped)
        assert len(got) == len(batches) == len(wrapped)
        for batch, host in zip(batches, got):
            _compare(_in_step(reference, batch), adopt_shard(trainer, host), host)
        assert receivers() == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_order_is_the_loaders(workers: int) -> None:
    assert _numbers(list(CPLoader(_loader(workers, n=23), prefetch=1))) == list(range(23))
    assert _numbers(list(CPLoader(_loader(workers, n=23), prefetch=4))) == list(range(23))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_worker_exception_reaches_the_loop_with_its_message(workers: int) -> None:
    it = iter(CPLoader(_loader(workers, n=8, fail_at=3)))
    assert _numbers([next(it) for _ in range(3)]) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"sample 3 is unreadable \(a bad record\)"):
        next(it)
    assert receivers() == 0  # the pass ends at the error
    with pytest.raises(StopIteration):
        next(it)


def test_a_worker_exception_leaves_no_worker_for_the_garbage_collector() -> None:
    # The worker's exception holds the loader's iterator through its traceback's frames, in a
    # cycle: unless the receiver clears them, the iterator (and its workers) live until a
    # garbage collection, whose worker shutdown then waits seconds per worker in a later step.
    import gc
    import multiprocessing

    enabled = gc.isenabled()
    gc.disable()
    try:
        it = iter(CPLoader(_loader(2, n=8, fail_at=3)))
        with pytest.raises(ValueError, match="sample 3 is unreadable"):
            for _ in range(4):
                next(it)
        assert receivers() == 0
        # The receiver has ended (joined by the raising next): the iterator went with it and
        # shut its workers down, no collection needed.
        assert multiprocessing.active_children() == []
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("workers", [0, 2])
def test_break_del_and_a_failing_step_stop_the_receiver(workers: int) -> None:
    wrapped = CPLoader(_loader(workers, n=50), prefetch=2)
    for x in wrapped:
        assert _numbers([x]) == [0]
        break
    assert receivers() == 0
    it = iter(wrapped)
    assert _numbers([next(it), next(it)]) == [0, 1]
    del it
    assert receivers() == 0
    with pytest.raises(KeyError, match="the step failed"):
        for x in wrapped:
            raise KeyError("the step failed")
    assert receivers() == 0
    it = iter(wrapped)
    next(it)
    again = iter(wrapped)  # a new pass closes the one before it
    assert receivers() == 1
    assert _numbers(list(again)) == list(range(50))
    assert _numbers(list(it)) == []  # the closed pass yields nothing more
    assert receivers() == 0


def test_exit_without_closing_does_not_hang(tmp_path: Path) -> None:
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from torch.utils.data import DataLoader
        from cp_core.loader import CPLoader
        from test_loader_prefetch import Numbered

        if __name__ == "__main__":
            LEFT = iter(CPLoader(DataLoader(Numbered(1000), batch_size=1, num_workers=2,
                                            persistent_workers=True)))
            print("got", int(next(LEFT)["i"]), flush=True)
    """))
    # The timeout only turns a hang into a failure; a clean exit takes a few seconds.
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "got 0"


def test_the_exit_handler_stops_a_pass_that_is_still_receiving() -> None:
    """What runs at interpreter exit (``atexit``): every open pass is stopped and its
    receiver waited for while the interpreter is whole (a receiver still inside torch's C++
    code when torch's globals are destroyed aborted the process, exit code 134, about one run
    in five of the script below)."""
    from cp_core import prefetch

    it = iter(CPLoader(_loader(2, n=10_000), prefetch=4))
    assert _numbers([next(it), next(it)]) == [0, 1]
    assert receivers() == 1 and it in prefetch._OPEN
    prefetch._close_open_passes()
    assert receivers() == 0
    with pytest.raises(StopIteration):  # the pass is over, not broken
        next(it)


def test_exit_while_receiving_large_batches_exits_cleanly(tmp_path: Path) -> None:
    """A script that stops reading a busy loader (two workers, large batches, the receiver
    mid-transfer) and ends exits with code 0."""
    script = tmp_path / "busy.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader, Dataset
        from cp_core.loader import CPLoader

        class Big(Dataset):
            def __len__(self):
                return 10_000

            def __getitem__(self, i):
                return {"i": torch.tensor(i), "x": torch.zeros(1 << 18)}

        if __name__ == "__main__":
            LEFT = iter(CPLoader(DataLoader(Big(), batch_size=4, num_workers=2), prefetch=4))
            for _ in range(3):
                next(LEFT)
            print("left", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip() == "left"


def test_prefetch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefetch must be an int >= 1, got 0"):
        CPLoader([], prefetch=0)
