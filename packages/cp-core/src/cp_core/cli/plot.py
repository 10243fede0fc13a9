"""The picture of a layout: token ownership along the sequence above per-rank work bars.

Top panel: one strip per stream row, each global position coloured by the rank that owns it
(pad slots in a paler shade), document boundaries drawn as black ticks. Bottom panel: the
attention work of every rank (token slots when the work is unknown) with the mean as a dashed
line. matplotlib runs on the Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cp_core.planning import LayoutPlan

#: At most this many stream rows are drawn; a note says how many were left out.
MAX_ROWS_DRAWN = 8


def rank_colours(n: int) -> np.ndarray:
    """``[n, 3]`` RGB colours, distinct for neighbouring ranks."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    if n <= 20:
        return np.asarray([cmap(i)[:3] for i in range(n)])
    return np.asarray([cmap(i / max(1, n - 1))[:3] for i in range(n)])


def _ownership_rgb(plan: LayoutPlan, colours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rgb [R, S, 3], doc_ids [R, S])`` of the drawn rows (pad slots paled towards white)."""
    owner = plan.owner.numpy()
    if plan.doc_ids is not None:
        ids = plan.doc_ids.numpy()[:MAX_ROWS_DRAWN, : owner.shape[0]]
    else:
        ids = np.ones((1, owner.shape[0]), dtype=np.int64)
    rgb = np.ones((ids.shape[0], owner.shape[0], 3))
    owned = owner >= 0
    rgb[:, owned] = colours[owner[owned]]
    pad = ids == 0
    rgb[pad] = 0.35 * rgb[pad] + 0.65  # pale: still shows the owner, clearly not a token
    return rgb, ids


def draw_layout(plan: LayoutPlan, path: str | Path, *, title: str | None = None,
                width_in: float = 12.0, dpi: int = 100) -> tuple[int, int]:
    """Write the layout picture of ``plan`` to ``path`` (PNG); returns ``(width, height)`` px."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = rank_colours(plan.cp_size)
    rgb, ids = _ownership_rgb(plan, colours)
    rows, seq = ids.shape
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(width_in, 2.4 + 0.35 * rows + 2.6), dpi=dpi,
        gridspec_kw={"height_ratios": [1.0 + 0.25 * rows, 2.0]},
    )
    top.imshow(rgb, aspect="auto", interpolation="nearest", extent=(0, seq, rows, 0))
    for r in range(rows):
        starts = np.flatnonzero(np.diff(ids[r]) != 0) + 1
        if starts.size:
            top.vlines(starts, r, r + 1, colors="black", linewidth=0.8)
    top.set_xlim(0, seq)
    top.set_yticks(np.arange(rows) + 0.5, [f"row {r}" for r in range(rows)])
    top.set_xlabel("global stream position (colour = owning rank, pale = pad, | = document start)")
    left_out = 0 if plan.doc_ids is None else plan.doc_ids.shape[0] - rows
    if left_out > 0:
        top.set_title(f"token ownership ({left_out} more rows not drawn)", fontsize=10)
    else:
        top.set_title("token ownership", fontsize=10)
    if plan.cp_size <= 16:
        top.legend(handles=[Patch(color=colours[r], label=f"rank {r}")
                            for r in range(plan.cp_size)],
                   loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    ranks = np.arange(plan.cp_size)
    if plan.has_work:
        values = np.asarray([r.work for r in plan.ranks], dtype=np.float64)
        label, balance = "attention work (allowed q·k pairs)", plan.work_balance
    else:
        values = np.asarray([r.tokens for r in plan.ranks], dtype=np.float64)
        label, balance = "token slots (attention work unknown)", plan.token_balance
    bottom.bar(ranks, values, color=colours[ranks])
    bottom.axhline(values.mean(), color="black", linestyle="--", linewidth=1, label="mean")
    bottom.set_xticks(ranks, [str(r) for r in ranks])
    bottom.set_xlabel("CP rank")
    bottom.set_ylabel(label)
    bottom.set_title(f"max/mean = {balance:.4f}", fontsize=10)
    bottom.legend(loc="lower right", fontsize=8)
    fig.suptitle(title or f"{plan.backend}, cp={plan.cp_size}", fontsize=12)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    width, height = fig.canvas.get_width_height()
    plt.close(fig)
    return int(width), int(height)


__all__ = ["draw_layout", "rank_colours", "MAX_ROWS_DRAWN"]
