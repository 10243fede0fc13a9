"""The ``locality`` backend: balance without traffic.

A document shorter than a rank's share is placed whole on one rank (its queries then need no
remote key), a long one is cut graded head-tail over just enough ranks, while attention work
and tokens per rank stay balanced: :mod:`~cp_magi.locality.units` (units and their costs per
attention kind), :mod:`~cp_magi.locality.slicing` and :mod:`~cp_magi.locality.anchors` (the
long units), :mod:`~cp_magi.locality.pack`, :mod:`~cp_magi.locality.stones`,
:mod:`~cp_magi.locality.bins` and :mod:`~cp_magi.locality.expand` (filling the ranks),
:mod:`~cp_magi.locality.sweep` (the two-ended sweep, tried first), with
:mod:`~cp_magi.locality.ring_order`, :mod:`~cp_magi.locality.heavy`,
:mod:`~cp_magi.locality.front` and :mod:`~cp_magi.locality.cut_score` (its cut units cut
again), :mod:`~cp_magi.locality.lean` (the direct construction),
:mod:`~cp_magi.locality.stairs` (long units over consecutive ranks under a bound on received
rows, where the first constructions leave the busiest rank above 0.8x round_robin's),
:mod:`~cp_magi.locality.solver` (the search), :mod:`~cp_magi.locality.sharder` and
:mod:`~cp_magi.locality.backend` (the backend).
"""

from cp_magi.locality.backend import BACKEND, LocalityConfig
from cp_magi.locality.sharder import place_stream, shard_batch_locality
from cp_magi.locality.solver import Placement, solve

__all__ = ["BACKEND", "LocalityConfig", "place_stream", "shard_batch_locality", "Placement",
           "solve"]
