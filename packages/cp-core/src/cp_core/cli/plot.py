"""The picture of a layout: token ownership along the sequence above per-rank work bars.

Top panel: one strip per stream row, each global position coloured by the rank that owns it
(pad slots in a paler shade over a dark band that stays visible however short the run),
document starts drawn as black ticks. When the stream has more slots than the strip has
pixels, each column shows its slots' owners in proportion (no aliasing). Bottom panel: the
attention work of every rank (token slots when the work is unknown) with the mean as a dashed
line. matplotlib runs on the Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cp_core.rank_stats import LayoutPlan

#: At most this many stream rows are drawn; a note says how many were left out.
MAX_ROWS_DRAWN = 8


def rank_colours(n: int) -> np.ndarray:
    """``[n, 3]`` RGB colours, distinct for neighbouring ranks."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    if n <= 20:
        return np.asarray([cmap(i)[:3] for i in range(n)])
    return np.asarray([cmap(i / max(1, n - 1))[:3] for i in range(n)])


#: Vertical cells per drawn row when ownership is binned (the resolution of the shares).
CELLS_PER_ROW = 16
#: A pad run is marked at least this wide (fraction of the stream) so that a few pad slots
#: in a long stream stay visible.
MIN_PAD_MARK = 0.006


def _drawn_ids(plan: LayoutPlan) -> np.ndarray:
    """``[R, S]`` document ids of the drawn rows (0 = pad; all 1 when the plan has none)."""
    seq = plan.owner.shape[0]
    if plan.doc_ids is not None:
        return plan.doc_ids.numpy()[:MAX_ROWS_DRAWN, :seq]
    return np.ones((1, seq), dtype=np.int64)


def ownership_image(plan: LayoutPlan, colours: np.ndarray, bins: int,
                    cells: int = CELLS_PER_ROW) -> np.ndarray:
    """``[R * cells, B, 3]`` RGB picture of the drawn rows at ``B = min(bins, S)`` columns.

    Each column is a bin of consecutive stream slots; its ``cells`` vertical cells are shared
    among the (rank, pad or not) classes of the bin's slots in proportion to their counts, so
    a layout that deals tokens finer than a pixel (token i on rank i mod cp) shows as evenly mixed
    colours instead of aliasing noise. At one slot per column this is the exact ownership.
    """
    owner = plan.owner.numpy()
    ids = _drawn_ids(plan)
    rows, seq = ids.shape
    n = len(colours)
    bins = max(1, min(bins, seq))
    palette = np.concatenate([colours, 0.35 * colours + 0.65, np.ones((1, 3))])  # real, pad, none
    column = (np.arange(seq) * bins) // seq
    image = np.ones((rows, cells, bins, 3))
    for r in range(rows):
        cls = np.where(owner < 0, 2 * n, owner + n * (ids[r] == 0))
        # One bincount over (column, class) pairs: far cheaper than np.add.at per slot.
        counts = np.bincount(column * (2 * n + 1) + cls, minlength=bins * (2 * n + 1)
                             ).reshape(bins, 2 * n + 1).astype(np.float64)
        share = np.cumsum(counts / counts.sum(axis=1, keepdims=True), axis=1)
        centre = (np.arange(cells) + 0.5) / cells
        pick = (share[:, None, :] < centre[None, :, None]).sum(axis=2)  # [bins, cells]
        image[r] = palette[np.minimum(pick, 2 * n)].transpose(1, 0, 2)
    return image.reshape(rows * cells, bins, 3)


#: Most rank labels an axis gets; more ranks are labelled every k-th.
MAX_RANK_LABELS = 16


def _thinned(size: int, most: int = MAX_RANK_LABELS) -> list[int]:
    """Rank numbers to label: all up to ``most``, else every k-th (the last rank included)."""
    step = max(1, -(-size // most))
    ticks = list(range(0, size, step))
    if ticks[-1] != size - 1 and size - 1 - ticks[-1] >= step // 2:
        ticks.append(size - 1)
    return ticks


def document_starts(ids_row: np.ndarray) -> np.ndarray:
    """Positions where a document starts after another one (not where padding starts)."""
    changes = np.flatnonzero(np.diff(ids_row) != 0) + 1
    return changes[ids_row[changes] != 0]


def pad_runs(ids_row: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of pad slots (document id 0)."""
    pad = np.concatenate([[False], ids_row == 0, [False]])
    edges = np.flatnonzero(np.diff(pad.astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def draw_layout(plan: LayoutPlan, path: str | Path, *, title: str | None = None,
                width_in: float = 12.0, dpi: int = 100) -> tuple[int, int]:
    """Write the layout picture of ``plan`` to ``path`` (PNG); returns ``(width, height)`` px."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from matplotlib.patches import Rectangle

    colours = rank_colours(plan.cp_size)
    ids = _drawn_ids(plan)
    rows, seq = ids.shape
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(width_in, 2.4 + 0.35 * rows + 2.6), dpi=dpi,
        gridspec_kw={"height_ratios": [1.0 + 0.25 * rows, 2.0]},
    )
    columns = int(0.8 * width_in * dpi)  # about the pixels the strip gets
    top.imshow(ownership_image(plan, colours, columns), aspect="auto", interpolation="nearest",
               extent=(0, seq, rows, 0))
    # Marks denser than a few pixels apart would paint the strip black: past that many they
    # are summarised in the axis label instead of drawn.
    most_marks = max(1, columns // 6)
    hidden: list[str] = []
    for r in range(rows):
        starts = document_starts(ids[r])
        if starts.size > most_marks:
            hidden.append(f"row {r}: {starts.size} document starts")
        elif starts.size:
            top.vlines(starts, r, r + 1, colors="black", linewidth=0.8)
        pads = pad_runs(ids[r])
        if len(pads) > most_marks:
            hidden.append(f"row {r}: {len(pads)} pad runs ({sum(b - a for a, b in pads):,} "
                          "slots)")
            continue
        for a, b in pads:  # a dark band under each pad run, visible however short
            top.add_patch(Rectangle((a, r + 0.82), max(b - a, MIN_PAD_MARK * seq), 0.18,
                                    color="0.25", linewidth=0))
    top.set_xlim(0, seq)
    top.set_yticks(np.arange(rows) + 0.5, [f"row {r}" for r in range(rows)])
    mixed = " (a column mixes several slots: colours in proportion)" if seq > columns else ""
    top.set_xlabel("global stream position: colour = owning rank, pale with a dark band = pad, "
                   f"| = document start{mixed}" + (
                       "\nnot marked (too dense to draw): " + "; ".join(hidden[:3])
                       + (f"; {len(hidden) - 3} more rows" if len(hidden) > 3 else "")
                       if hidden else ""))
    left_out = 0 if plan.doc_ids is None else plan.doc_ids.shape[0] - rows
    if left_out > 0:
        top.set_title(f"token ownership ({left_out} more rows not drawn)", fontsize=10)
    else:
        top.set_title("token ownership", fontsize=10)
    if plan.cp_size <= 16:
        top.legend(handles=[Patch(color=colours[r], label=f"rank {r}")
                            for r in range(plan.cp_size)],
                   loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    else:  # one legend entry per rank would not fit: a colour scale of the rank numbers
        from matplotlib.colors import ListedColormap, Normalize
        from matplotlib.cm import ScalarMappable

        scale = ScalarMappable(Normalize(-0.5, plan.cp_size - 0.5), ListedColormap(colours))
        fig.colorbar(scale, ax=top, label="rank", ticks=_thinned(plan.cp_size, 5), pad=0.01)

    ranks = np.arange(plan.cp_size)
    if plan.has_work:
        values = np.asarray([r.work for r in plan.ranks], dtype=np.float64)
        label, balance = "attention work (allowed q·k pairs)", plan.work_balance
    else:
        values = np.asarray([r.tokens for r in plan.ranks], dtype=np.float64)
        label, balance = "token slots (attention work unknown)", plan.token_balance
    bottom.bar(ranks, values, color=colours[ranks])
    bottom.axhline(values.mean(), color="black", linestyle="--", linewidth=1, label="mean")
    ticks = _thinned(plan.cp_size)
    bottom.set_xticks(ticks, [str(r) for r in ticks])
    bottom.set_xlim(-0.6, plan.cp_size - 0.4)
    bottom.set_xlabel("CP rank" + (f" (every {ticks[1] - ticks[0]}th labelled)"
                                   if len(ticks) > 1 and ticks[1] - ticks[0] > 1 else ""))
    bottom.set_ylabel(label)
    busiest = int(np.argmax(values))
    bottom.set_title(f"max/mean = {balance:.4f}; busiest rank {busiest}, least "
                     f"{int(np.argmin(values))}", fontsize=10)
    bottom.legend(loc="lower right", fontsize=8)
    fig.suptitle(title or f"{plan.backend}, cp={plan.cp_size}", fontsize=12)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    width, height = fig.canvas.get_width_height()
    plt.close(fig)
    return int(width), int(height)


__all__ = ["draw_layout", "rank_colours", "ownership_image", "document_starts", "pad_runs",
           "MAX_ROWS_DRAWN"]
