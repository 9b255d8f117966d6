"""Plotting helpers every result's `plot(ax=None)` uses: a headless-safe pyplot, figure/axes creation that
honours a given `ax` (one Axes, or a sequence for multi-panel plots), and the shared diverging heatmap."""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np


def pyplot():
    """matplotlib.pyplot, imported lazily (the Agg backend is chosen when there is no display and no
    notebook backend, so plotting never fails on a headless machine)."""
    import matplotlib

    if (
        matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline")
        and not _has_display()
    ):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def figure_axes(ax=None, figsize: Tuple[float, float] = (6.5, 3.8)):
    """(figure, axes): the given Axes and its figure, or a new figure with one Axes of `figsize`."""
    if ax is not None:
        if isinstance(ax, (list, tuple, np.ndarray)):
            ax = np.ravel(ax)
            if len(ax) != 1:
                raise ValueError(f"this plot draws one panel; pass one Axes, got {len(ax)}")
            ax = ax[0]
        return ax.figure, ax
    fig, new = pyplot().subplots(figsize=figsize)
    return fig, new


def panels(
    ax,
    n: int,
    figsize: Tuple[float, float],
    ncols: Optional[int] = None,
    width_ratios: Optional[Sequence[float]] = None,
) -> Tuple[Any, List[Any]]:
    """(figure, n axes) for a multi-panel plot.

    ax=None: a new figure of `figsize` with the panels in a grid of `ncols` columns (default: one row).
    ax a sequence of n Axes: those (in one figure). ax one Axes: its slot in its figure is split into the
    n panels (the Axes is replaced), so a multi-panel plot can still be placed into a caller's layout."""
    ncols = ncols or n
    nrows = -(-n // ncols)
    if ax is None:
        fig, axes = pyplot().subplots(nrows, ncols, figsize=figsize, squeeze=False, width_ratios=width_ratios)
        axes = list(axes.ravel())
        for extra in axes[n:]:
            extra.axis("off")
        return fig, axes[:n]
    if isinstance(ax, (list, tuple, np.ndarray)):
        axes = list(np.ravel(ax))
        if len(axes) != n:
            raise ValueError(
                f"this plot draws {n} panels; pass {n} Axes (or one, to split, or none), got {len(axes)}"
            )
        return axes[0].figure, axes
    if n == 1:
        return ax.figure, [ax]
    spec = ax.get_subplotspec()
    if spec is None:
        raise ValueError(f"this plot draws {n} panels; pass a sequence of {n} Axes or a grid Axes to split")
    fig = ax.figure
    grid = spec.subgridspec(nrows, ncols, width_ratios=width_ratios)
    ax.remove()
    axes = [fig.add_subplot(grid[i // ncols, i % ncols]) for i in range(n)]
    return fig, axes


def finish(fig, created: bool):
    """Tidy the layout of a figure this plot created (a caller's figure keeps its own layout)."""
    if created:
        fig.tight_layout()
    return fig


def diverging_heatmap(
    ax,
    matrix: np.ndarray,
    *,
    xlabels: Optional[Sequence[Any]] = None,
    ylabels: Optional[Sequence[Any]] = None,
    label: str = "",
    limit: Optional[float] = None,
    annotations: Optional[np.ndarray] = None,
    fontsize: int = 7,
    xrotation: float = 0,
):
    """A heatmap centred at 0 (red positive, blue negative, symmetric limits: `limit` or max |value|),
    with tick labels, a colourbar labelled `label` and optional per-cell text. Returns the image."""
    matrix = np.asarray(matrix, dtype=np.float64)
    if limit is None:
        limit = float(np.nanmax(np.abs(matrix))) if np.isfinite(matrix).any() else 1.0
        limit = limit or 1.0
    im = ax.imshow(matrix, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit)
    if xlabels is not None:
        ax.set_xticks(range(len(xlabels)))
        ax.set_xticklabels(
            [str(x) for x in xlabels],
            fontsize=fontsize,
            rotation=xrotation,
            ha="right" if xrotation else "center",
        )
    if ylabels is not None:
        ax.set_yticks(range(len(ylabels)))
        ax.set_yticklabels([str(y) for y in ylabels], fontsize=fontsize)
    if annotations is not None:
        for (i, j), text in np.ndenumerate(np.asarray(annotations, dtype=object)):
            if text:
                ax.text(j, i, str(text), ha="center", va="center", fontsize=fontsize)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, label=label)
    return im


def sender_receiver_heatmap(
    grid: np.ndarray, senders: Sequence[str], receivers: Sequence[str], label: str, title: str, ax=None
):
    """A senders x receivers grid (NaN: no such path, left blank) on a symmetric diverging scale; drawn into
    `ax` when given. Returns the Figure."""
    plt = pyplot()
    fig, ax = (
        (ax.figure, ax)
        if ax is not None
        else plt.subplots(figsize=(max(5, 0.3 * len(receivers) + 2), max(2.5, 0.3 * len(senders) + 1.5)))
    )
    finite = grid[np.isfinite(grid)]
    lim = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="RdBu", vmin=-lim, vmax=lim)
    ax.set_xticks(range(len(receivers)))
    ax.set_xticklabels(receivers, rotation=90, fontsize=7)
    ax.set_yticks(range(len(senders)))
    ax.set_yticklabels(senders, fontsize=7)
    ax.set_xlabel("receiver")
    ax.set_ylabel("sender")
    fig.colorbar(im, ax=ax, label=label)
    ax.set_title(title)
    fig.tight_layout()
    return fig
