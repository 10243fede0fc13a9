"""``cp.transport`` under blockdiag picks the kernel over its own exchange, never a transport
it would silently ignore."""

from __future__ import annotations

import pytest

from cp_core.errors import CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder


@pytest.mark.parametrize("name", ["p2p", "allgather"])
def test_kernel_choices_are_accepted(name: str) -> None:
    build_sharder({"backend": "blockdiag", "size": 2, "transport": name}, SimulatedCPMesh(0, 2))


def test_ulysses_is_refused_naming_the_key() -> None:
    with pytest.raises(CPConfigError, match=r"cp.transport='ulysses' is not honoured by blockdiag"):
        build_sharder({"backend": "blockdiag", "size": 2, "transport": "ulysses"},
                      SimulatedCPMesh(0, 2))


def test_unknown_transport_lists_the_installed_ones() -> None:
    with pytest.raises(CPConfigError, match=r"unknown transport 'ring'.*'p2p'"):
        build_sharder({"backend": "round_robin", "size": 2, "transport": "ring"},
                      SimulatedCPMesh(0, 2))
