"""PNG plots of a run (matplotlib, no display needed).

For every benchmark whose rows carry the plot keys ``variant``, ``bs`` and ``series``, one
PNG ``<benchmark>.png``: one line of panels per series, with time against batch size per
variant (left; a dashed ``floor`` line where rows carry ``floor``, one a variant where several
variants carry floors, e.g. a bf16 and an FP8 cache) and the ratio
``baseline / variant`` against batch size (right; above 1: faster than the baseline). A
variant whose rows carry ``graphs="eager stand-in"`` (a graph variant with no device graph) is
labelled so, and its ratio panel says the ratio is noise, not a speedup.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Dict, Iterable, List

from .report import STAND_IN

__all__ = ["plot_rows", "write_plots"]


def plot_rows(rows: Iterable[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, Dict[int, float]]]]:
    """benchmark -> series -> variant -> {bs: value} of the measured rows with plot keys."""
    out: Dict[str, Dict[str, Dict[str, Dict[int, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("value") is None or r.get("variant") is None or r.get("bs") is None:
            continue
        series = str(r.get("series") or r.get("metric") or "")
        out[r["benchmark"]][series].setdefault(str(r["variant"]), {})[int(r["bs"])] = float(r["value"])
    return out


def write_plots(rows: List[Dict[str, Any]], out_dir: str, baseline: str) -> List[str]:
    """Write the PNGs described in the module docstring into ``out_dir``; returns their
    paths. Raises ``ImportError`` when matplotlib is not installed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    os.makedirs(out_dir, exist_ok=True)
    units = {
        (r["benchmark"], str(r.get("series") or r.get("metric") or "")): (r.get("metric"), r.get("unit"))
        for r in rows
        if r.get("variant") is not None and r.get("bs") is not None
    }
    # variants measured through the eager stand-in (no device graph): labelled so in every panel
    stand_in = {
        (r["benchmark"], str(r.get("series") or r.get("metric") or ""), str(r["variant"]))
        for r in rows
        if r.get("graphs") == STAND_IN and r.get("variant") is not None
    }
    floors: Dict[tuple, Dict[str, Dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("floor") is not None and r.get("bs") is not None:
            key = (r["benchmark"], str(r.get("series") or r.get("metric") or ""))
            floors[key][str(r.get("variant"))][int(r["bs"])] = float(r["floor"])
    paths = []
    for bench, by_series in sorted(plot_rows(rows).items()):
        fig = Figure(figsize=(11, 3.6 * len(by_series)), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(by_series), 2, squeeze=False)
        for (series, variants), (ax_t, ax_r) in zip(sorted(by_series.items()), axes):
            metric, unit = units.get((bench, series), ("time", ""))

            def name(variant: str, bench=bench, series=series) -> str:
                return f"{variant} ({STAND_IN})" if (bench, series, variant) in stand_in else variant

            noise = any((bench, series, v) in stand_in for v in variants)
            for variant, points in sorted(variants.items()):
                xs = sorted(points)
                ax_t.plot(xs, [points[x] for x in xs], marker="o", label=name(variant))
            floored = floors.get((bench, series), {})
            for variant, floor in sorted(floored.items()):
                xs = sorted(floor)
                one = len(floored) == 1
                style = {"color": "black"} if one else {}
                ax_t.plot(
                    xs, [floor[x] for x in xs], linestyle="--", label="floor" if one else f"floor ({variant})", **style
                )
            ax_t.set_title(f"{bench}: {series}")
            ax_t.set_xlabel("batch size")
            ax_t.set_ylabel(f"{metric} ({unit})" if unit else str(metric))
            ax_t.legend()
            base = variants.get(baseline)
            ax_r.axhline(1.0, color="grey", linewidth=0.8)
            if base:
                for variant, points in sorted(variants.items()):
                    if variant == baseline:
                        continue
                    xs = [x for x in sorted(points) if x in base and points[x] > 0]
                    ax_r.plot(xs, [base[x] / points[x] for x in xs], marker="o", label=f"{baseline} / {name(variant)}")
                ax_r.legend()
            else:
                ax_r.text(
                    0.5, 0.5, f"no {baseline!r} baseline measured", ha="center", va="center", transform=ax_r.transAxes
                )
            if noise:  # two eager runs: the ratio is noise, and the panel says so
                ax_r.set_title(f"ratio vs {baseline}: {STAND_IN}, no device graph (noise, not a speedup)")
            else:
                ax_r.set_title(f"ratio vs {baseline} (above 1: faster)")
            ax_r.set_xlabel("batch size")
            ax_r.set_ylabel("x")
            sizes = sorted({x for pts in variants.values() for x in pts})
            for ax in (ax_t, ax_r):
                if len(sizes) > 1:
                    ax.set_xscale("log", base=2)
                ax.set_xticks(sizes, [str(x) for x in sizes])
                ax.minorticks_off()
                ax.grid(True, alpha=0.3)
        path = os.path.join(out_dir, f"{bench}.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths
