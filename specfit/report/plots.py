"""Figure helpers shared by the report sections (matplotlib, one look for every figure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

__all__ = ["new_axes", "log_x", "legend_outside", "identity_scatter", "bars", "grouped_bars", "POLICY_PALETTE",
           "POLICY_MARKERS", "POLICY_LINESTYLES", "BAR_HATCHES", "BAR_HANDLE",
           "PolicyStyle", "policy_styles"]

# matplotlib's default cycle (tab10), then the light halves of tab20 and tab20b's and tab20c's dark
# and middle shades: 35 colours, so that a page of many policies (a sweep's and a decode's) does not
# give two of them one colour (after 35 the palette wraps)
POLICY_PALETTE = tuple(to_hex(c) for c in (*colormaps["tab10"].colors, *colormaps["tab20"].colors[1::2],
                                           *colormaps["tab20b"].colors[::4], *colormaps["tab20c"].colors[::4],
                                           *colormaps["tab20b"].colors[2::4]))


# a marker per policy beside its colour: a reader who cannot tell the colours apart (one man in
# twelve), or a greyscale print, matched a line to its legend entry by nothing. Filled shapes whose
# outlines differ; eight, prime to the palette's 35, so that no two of a page's first 280 policies
# share both colour and marker
POLICY_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# and a line style, for the figures whose lines lie on one another (a histogram's outlines)
POLICY_LINESTYLES = ("-", "--", "-.", ":")
# and a bar's hatch, for the bar figures, where a series had its colour alone (its bars side by
# side with the others'): six, prime to the palette's 35, so that no two of a figure's first 210
# series share both colour and hatch. Lines only: a dotted or circled hatch is drawn as a pattern
# of many small paths (".." 68 KB a colour in the SVG, where "//" is 0.5 KB)
BAR_HATCHES = ("", "//", "xx", "\\\\", "--", "++")
# a legend's patches this tall and long (in font sizes), where a hatch shows a few of its strokes
# (matplotlib's 0.7 high showed a sliver of it)
BAR_HANDLE = {"handleheight": 1.6, "handlelength": 2.4}
# a line of more points than this (a run's cycles) is marked every k-th point, about this many
# times: a marker on each of 2,000 cycles was a smear that hid the line
MARKS_PER_LINE = 20


@dataclass(frozen=True)
class PolicyStyle:
    """How one policy is drawn in every figure of a page."""

    color: str
    marker: str
    linestyle: str
    hatch: str = ""

    def marked(self, points: int, line: int = 0, lines: int = 1) -> dict:
        """matplotlib's keywords for a line of ``points`` points in this colour with this marker:
        on every point up to :data:`MARKS_PER_LINE`, else on every k-th, the ``line``-th of
        ``lines`` lines starting its marks k * line / lines in (lines on one another do not stack
        their markers)."""
        step = max(1, math.ceil(points / MARKS_PER_LINE))
        return {"color": self.color, "marker": self.marker, "markevery": (step * line // lines, step)}


def policy_styles(policies, given: dict | None = None) -> dict[str, PolicyStyle]:
    """One colour, marker, line style and hatch per policy: ``given``'s (the page's so far) kept,
    the ``k``-th policy new to it the ``k``-th of :data:`POLICY_PALETTE`, :data:`POLICY_MARKERS`,
    :data:`POLICY_LINESTYLES` and :data:`BAR_HATCHES` (each wrapping), in the order named. A
    figure that took the next colour of the cycle gave a policy a colour by its place among the
    figure's lines, so the same policy changed colour from one figure to the next."""
    styles = dict(given or {})
    for policy in map(str, policies):
        if policy not in styles:
            k = len(styles)
            styles[policy] = PolicyStyle(POLICY_PALETTE[k % len(POLICY_PALETTE)],
                                         POLICY_MARKERS[k % len(POLICY_MARKERS)],
                                         POLICY_LINESTYLES[k % len(POLICY_LINESTYLES)],
                                         BAR_HATCHES[k % len(BAR_HATCHES)])
    return styles


def new_axes(width: float = 6.4, height: float = 3.6):
    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    ax.grid(alpha=0.3)
    return fig, ax


def log_x(ax) -> None:
    """Put ``ax``'s x axis on a log scale with ticks that are plain numbers (1, 10, 100). The
    report draws with ``text.parse_math`` off, so that a '$' in a trace, profile or policy name is
    text (:func:`specfit.report.build.build_report`); matplotlib's own log ticks are mathtext
    (``$\\mathdefault{10^{0}}$``) and printed as written."""
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(LogFormatter())
    ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))     # labels a short axis's minor ticks


def legend_outside(ax, **legend) -> None:
    """The legend to the right of the axes, where it covers no line however the data fall (inside,
    it sat on the highest line of a figure whose lines climb to its top right); ``legend``: more of
    matplotlib's legend keywords."""
    ax.legend(**{"fontsize": 8, **legend}, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


# above this many points a scatter is drawn as an image inside the SVG: one vector marker per
# cycle made a long run's page an order of magnitude larger (benchmarks/RESULTS.md, "Stop 50: four
# more audits")
RASTER_ABOVE = 2000


def identity_scatter(measured, predicted, xlabel: str, ylabel: str, color=None, color_label: str = "",
                     groups=None, group_styles: dict | None = None):
    """Predicted vs measured with the identity line and the MAPE in the title; ``color`` shades
    points by a number (with a colour bar), ``groups`` labels them by category (with a legend, each
    in its colour and marker of ``group_styles`` where it has them)."""
    measured, predicted = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    raster = measured.size > RASTER_ABOVE
    fig, ax = new_axes(5.2, 4.4)
    if groups is not None:
        groups = np.asarray(groups)
        for name in dict.fromkeys(groups.tolist()):
            sel = groups == name
            style = (group_styles or {}).get(str(name))
            look = {"color": style.color, "marker": style.marker} if style else {}
            ax.scatter(measured[sel], predicted[sel], s=14, alpha=0.75, label=str(name), rasterized=raster, **look)
        ax.legend(fontsize=8)
    else:
        shade = {} if color is None else {"c": np.asarray(color), "cmap": "viridis"}
        sc = ax.scatter(measured, predicted, s=14, alpha=0.75, rasterized=raster, **shade)
        if color is not None:
            fig.colorbar(sc, ax=ax, label=color_label)
    hi = float(np.nanmax(np.concatenate([measured, predicted]))) * 1.05 if measured.size else 1.0
    ax.plot([0, hi], [0, hi], color="grey", lw=1)
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel=xlabel, ylabel=ylabel)
    if measured.size:
        mape = np.mean(np.abs(predicted - measured) / measured)
        ax.set_title(f"MAPE {mape:.1%} over {measured.size} points", fontsize=10)
    return fig


def bars(labels, values, ylabel: str, annotations=None, title: str = "", colors=None):
    """A bar chart with an optional label above each bar (e.g. a speedup); ``colors``: one per bar."""
    fig, ax = new_axes(max(4.0, 0.75 * len(labels) + 2), 3.6)
    x = np.arange(len(labels))
    ax.bar(x, values, color="#4a78b5" if colors is None else list(colors))
    ax.set_xticks(x, [str(label) for label in labels], rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    for xi, v, note in zip(x, values, annotations or [None] * len(labels)):
        if note:
            ax.annotate(note, (xi, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    if annotations:
        ax.margins(y=0.12)          # room above the tallest bar for its label, inside the axes
    return fig


def grouped_bars(labels, groups: dict, ylabel: str, annotations: dict | None = None, title: str = ""):
    """Bars of several series side by side per label; ``groups`` maps a series name to values
    aligned with ``labels``, ``annotations`` the same to per-bar notes. The ``i``-th series in the
    ``i``-th colour of :data:`POLICY_PALETTE` and hatch of :data:`BAR_HATCHES`, drawn in white on
    it: told apart by colour alone, they were one grey in a greyscale print."""
    width = 0.8 / max(len(groups), 1)
    fig, ax = new_axes(max(5.0, 0.9 * len(labels) * max(1, len(groups) / 2) + 2), 3.8)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(groups.items()):
        pos = x - 0.4 + width * (i + 0.5)
        ax.bar(pos, values, width=width * 0.95, label=str(name), color=POLICY_PALETTE[i % len(POLICY_PALETTE)],
               hatch=BAR_HATCHES[i % len(BAR_HATCHES)], edgecolor="white")
        for xi, v, note in zip(pos, values, (annotations or {}).get(name, [None] * len(labels))):
            if note:
                ax.annotate(note, (xi, v), ha="center", va="bottom", fontsize=7, rotation=90, xytext=(0, 2),
                            textcoords="offset points")
    ax.set_xticks(x, [str(label) for label in labels], rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.18)
    # outside the axes: it never covers a bar or its label, and no "best" place is searched for
    # (matplotlib's search, slow on a loaded machine, warned in the tests)
    ax.legend(fontsize=8, **BAR_HANDLE, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    return fig
