"""An estimated attention step time per transport: compute from the pairs, links from the bytes.

Host only. The inputs are exact counts (:mod:`cp_core.plan.comm_model`): allowed (query, key)
pairs per rank and bytes per rank split into intra- and inter-node; the model around them is
deliberately simple and stated in full in the docs (``docs/reference/comm-model.md``):

* forward compute of a rank: ``2 * pairs * heads_on_rank * (Dk + Dv) / rate``; backward
  ``2.5x`` that (the recomputed scores, dV, dP, dQ and dK: five products to the forward's two);
* a transfer: ``intra_bytes / intra_bw + inter_bytes / inter_bw + messages * latency`` (the
  two links taken one after the other: an upper bound when they run concurrently);
* backward traffic: the ring sends K/V again and returns each peer's dK/dV share in float32
  (``1 + 4 / itemsize`` times the forward's ring bytes); the all-to-alls move the gradients of
  q, k, v and the output at the forward's dtype (the forward's all-to-all bytes again);
* without overlap a layer costs ``compute + a2a + ring``; with overlap the ring hides behind
  the compute, ``a2a + max(compute, ring)`` (an all-to-all's output is needed before any
  attention of the layer can start, so it is never hidden);
* the step: ``layers * (forward + backward)`` of the slowest rank. Only attention and its
  communication are modelled: the MLP, norms and the optimizer are the same for every
  transport and layout and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from cp_core.errors import CPConfigError

#: Backward compute over forward compute of flash-style attention.
BACKWARD_COMPUTE = 2.5
#: Bytes of the float32 dK/dV shares the ring returns in backward.
GRAD_ITEMSIZE = 4


@dataclass(frozen=True)
class Topology:
    """The cluster a run is sized for (bandwidths per GPU per direction)."""

    name: str
    gpus_per_node: int
    intra_gbps: float
    """Intra-node bandwidth per GPU per direction, GB/s (1e9 bytes)."""
    inter_gbps: float
    """Inter-node bandwidth per GPU per direction, GB/s."""
    intra_latency_us: float
    inter_latency_us: float
    tflops: float
    """Attention compute rate actually reached, TFLOP/s (not the datasheet peak)."""


#: Common nodes. Bandwidths are per GPU per direction; the compute rates are about half the
#: dense bf16 peak (989 TFLOP/s H100 SXM, 312 A100), what flash kernels sustain on long rows.
PRESETS: dict[str, Topology] = {
    "h100_nvlink_ib400": Topology("h100_nvlink_ib400", 8, 450.0, 50.0, 3.0, 10.0, 450.0),
    "a100_nvlink_ib200": Topology("a100_nvlink_ib200", 8, 300.0, 25.0, 3.0, 10.0, 150.0),
    "h100_pcie_eth100": Topology("h100_pcie_eth100", 8, 32.0, 12.5, 5.0, 20.0, 350.0),
}
DEFAULT_TOPOLOGY = "h100_nvlink_ib400"


def topology(name: str = DEFAULT_TOPOLOGY, overrides: Mapping[str, Any] | None = None
             ) -> Topology:
    """A preset with fields replaced (``{"inter_gbps": 25}``); errors name the key."""
    if name not in PRESETS:
        raise CPConfigError(f"topo={name!r}: presets are {sorted(PRESETS)}")
    base = PRESETS[name]
    names = {f.name for f in fields(Topology)} - {"name"}
    values: dict[str, Any] = {}
    for key, value in dict(overrides or {}).items():
        if key not in names:
            raise CPConfigError(f"unknown key topo.{key}; valid keys: {sorted(names)}")
        try:
            num = int(value) if key == "gpus_per_node" else float(value)
        except (TypeError, ValueError):
            raise CPConfigError(f"topo.{key}={value!r}: expected a number") from None
        if num <= 0 and not key.endswith("latency_us"):
            raise CPConfigError(f"topo.{key}={value}: must be > 0")
        values[key] = num
    return replace(base, **values) if values else base


@dataclass(frozen=True)
class RankLoad:
    """What one rank does in one attention layer's forward."""

    flops: float
    a2a_intra: int
    a2a_inter: int
    a2a_messages: int
    ring_intra: int
    ring_inter: int
    ring_messages: int


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of the attention part of one step (slowest rank)."""

    no_overlap: float
    overlap: float
    compute: float
    comm: float


def _link(topo: Topology, intra: float, inter: float, messages: int, remote: bool) -> float:
    lat = (topo.inter_latency_us if remote else topo.intra_latency_us) * 1e-6
    return intra / (topo.intra_gbps * 1e9) + inter / (topo.inter_gbps * 1e9) + messages * lat


def layer_times(load: RankLoad, topo: Topology, itemsize: int) -> tuple[float, float, float, float]:
    """``(no overlap, overlap, compute, communication)`` seconds of one layer, forward plus
    backward, for one rank (the formulas of the module docstring)."""
    comp_f = load.flops / (topo.tflops * 1e12)
    comp = comp_f * (1 + BACKWARD_COMPUTE)
    a2a = _link(topo, load.a2a_intra, load.a2a_inter, load.a2a_messages, load.a2a_inter > 0)
    ring_f = _link(topo, load.ring_intra, load.ring_inter, load.ring_messages,
                   load.ring_inter > 0)
    ring_b = _link(topo, load.ring_intra * (1 + GRAD_ITEMSIZE / itemsize),
                   load.ring_inter * (1 + GRAD_ITEMSIZE / itemsize), 2 * load.ring_messages,
                   load.ring_inter > 0)
    no_overlap = comp + 2 * a2a + ring_f + ring_b
    overlap = 2 * a2a + max(comp_f, ring_f) + max(comp_f * BACKWARD_COMPUTE, ring_b)
    return no_overlap, overlap, comp, 2 * a2a + ring_f + ring_b


def step_time(loads: list[RankLoad], topo: Topology, layers: int, itemsize: int) -> StepTime:
    """The slowest rank's attention step time over ``layers`` layers."""
    if not loads:
        raise CPConfigError("step_time needs at least one rank")
    per = [layer_times(x, topo, itemsize) for x in loads]
    worst = max(per, key=lambda t: t[1])
    return StepTime(no_overlap=layers * max(t[0] for t in per), overlap=layers * worst[1],
                    compute=layers * max(t[2] for t in per), comm=layers * max(t[3] for t in per))


__all__ = ["Topology", "PRESETS", "DEFAULT_TOPOLOGY", "topology", "RankLoad", "StepTime",
           "layer_times", "step_time", "BACKWARD_COMPUTE", "GRAD_ITEMSIZE"]
