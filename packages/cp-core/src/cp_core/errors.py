"""The library's exception types.

Each error subclasses the matching built-in so callers that already catch ``ValueError`` or
``KeyError`` keep working, while ``except CPError`` catches everything this library raises on
purpose.
"""

from __future__ import annotations


class CPError(Exception):
    """Base class of every error raised deliberately by cp_core and its backends."""


class CPBatchError(CPError, ValueError):
    """A batch (or a token-aligned tensor) has the wrong keys, shapes, dtypes or boundaries."""


class CPConfigError(CPError, ValueError):
    """A backend configuration value is unknown, out of range or inconsistent with the mesh."""


class CPLayoutError(CPError, RuntimeError):
    """A token verb was used without a layout, or ranks disagree on the layout they computed."""


class CPLayoutUnavailableError(CPLayoutError, NotImplementedError):
    """A token verb needs a shard layout that does not exist yet.

    Raised before the first ``shard`` of a data-dependent layout (nothing can place a token
    yet) and by ``gather_token_tensor(trim=True)`` with no layout to trim to. It is a
    :class:`CPLayoutError` and, as NeMo AutoModel raises for the same cases, a
    ``NotImplementedError``.
    """


class CPRankFailedError(CPError, RuntimeError):
    """A collective failed (timed out, lost its connection) because another rank of its group
    failed first; the message names that rank and its error, the raw error is chained.

    Attributes:
        failed_ranks: the global ranks whose failure was recorded.
    """

    failed_ranks: list[int]


class CPAttentionError(CPError, NotImplementedError):
    """The active attention transport cannot honour the requested attention (mask, kind, dropout)."""


class CPCheckpointError(CPAttentionError):
    """An attention call under activation checkpointing whose recomputation cannot be bound to
    the plan of the forward it belongs to; the message names the form that works."""


class CPBackendNotFoundError(CPError, KeyError):
    """An unknown backend name, or a known backend whose package is not installed."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class CPBackendLoadError(CPError, ImportError):
    """An installed backend was selected but failed to import; the cause is chained."""


__all__ = [
    "CPError",
    "CPBatchError",
    "CPConfigError",
    "CPLayoutError",
    "CPLayoutUnavailableError",
    "CPRankFailedError",
    "CPAttentionError",
    "CPCheckpointError",
    "CPBackendNotFoundError",
    "CPBackendLoadError",
]
