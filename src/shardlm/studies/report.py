"""What a study writes: markdown tables, PNG plots (matplotlib, imported only here and only
when drawing: the `plots` extra) and report.md. A plot is data first (`Plot`), drawn second, so
tests check the series that go into a figure without reading pixels."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Plot:
    name: str
    """File name without .png."""
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[tuple]] = field(default_factory=dict)
    """label -> [(x, y), ...]; bar plots take x as categories (in first-seen order)."""
    kind: str = "line"
    logx: bool = False
    logy: bool = False
    hline: tuple[float, str] | None = None
    """A horizontal reference (a memory cap, a device's capacity): (y, label)."""

    def add(self, label: str, x, y) -> None:
        if y is not None and not (isinstance(y, float) and math.isnan(y)):
            self.series.setdefault(label, []).append((x, y))


@dataclass
class Section:
    heading: str
    body: str


@dataclass
class StudyOutput:
    title: str
    question: str
    notes: list[str]
    sections: list[Section]
    plots: list[Plot]
    predicted: list[dict]
    """Every predicted row (predicted.jsonl)."""
    commands: list[tuple[str, str]]
    """(point label, `shardlm train` command) of every measured point."""


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def draw(plot: Plot, path: Path) -> None:
    """One PNG, small (about 30-60 KB): 6.4 x 3.6 in at 100 dpi."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if plot.kind == "bar":
        cats: list = []
        for pts in plot.series.values():
            cats += [x for x, _ in pts if x not in cats]
        width = 0.8 / max(1, len(plot.series))
        for i, (label, pts) in enumerate(plot.series.items()):
            values = dict(pts)
            xs = [j + (i - (len(plot.series) - 1) / 2) * width for j, c in enumerate(cats) if c in values]
            ax.bar(xs, [values[c] for c in cats if c in values], width, label=label)
        ax.set_xticks(range(len(cats)), [str(c) for c in cats], rotation=20 if len(cats) > 4 else 0,
                      fontsize=8)
    else:
        for label, pts in plot.series.items():
            pts = sorted(pts, key=lambda p: p[0])  # a search probes out of order
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    if plot.hline is not None:
        ax.axhline(plot.hline[0], color="grey", linestyle="--", linewidth=1, label=plot.hline[1])
    if plot.logx:
        ax.set_xscale("log", base=2)
    if plot.logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    xs = sorted({x for pts in plot.series.values() for x, _ in pts}) if plot.kind == "line" else []
    if xs and len(xs) <= 12 and all(isinstance(x, int) for x in xs):
        ax.set_xticks(xs, [str(x) for x in xs])  # stages, ranks, devices: no 0.5 or 2^k ticks
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_title(plot.title, fontsize=10)
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.grid(alpha=0.3)
    if plot.series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write(out: Path, study_output: StudyOutput, reproduce: str) -> Path:
    """report.md, one PNG per plot, predicted.jsonl and plots.json (the plotted data) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for plot in study_output.plots:
        draw(plot, out / f"{plot.name}.png")
    (out / "plots.json").write_text(json.dumps({p.name: p.series for p in study_output.plots}, indent=1))
    with open(out / "predicted.jsonl", "w") as f:
        for row in study_output.predicted:
            f.write(json.dumps(row) + "\n")
    s = study_output
    lines = [f"# {s.title}", "", s.question, "", f"Reproduce: `{reproduce}` (finished points in "
             f"points.jsonl are kept; delete it to measure again).", ""]
    lines += [f"- {n}" for n in s.notes] + [""]
    for section in s.sections:
        lines += [f"## {section.heading}", "", section.body, ""]
    lines += ["## Figures", ""] + [f"![{p.title}]({p.name}.png)" for p in s.plots] + [""]
    lines += ["## Measured points", "", "Each point is one `shardlm train` run (its rank-0 JSONL in "
              "raw/<key>.jsonl, its summary in points.jsonl):", ""]
    lines += [f"- {label}: `{command}`" for label, command in s.commands]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"
