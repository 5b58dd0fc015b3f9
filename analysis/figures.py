"""All figures, by name: `FIGURES[name](results) -> Figure` (raises NoData when data is absent).

Figure modules register themselves with `analysis.style.figure`; importing them here fills
the registry. A new figure is one decorated function in any of these modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt

# Importing a figure module registers its figures; the report shows them in this order.
from analysis import fig_perf  # noqa: F401,I001
from analysis import fig_ablation  # noqa: F401
from analysis import fig_traces  # noqa: F401
from analysis import fig_map  # noqa: F401
from analysis import fig_hetero  # noqa: F401
from analysis import fig_machine  # noqa: F401
from analysis.load import Results
from analysis.style import CAPTIONS, DPI, FIGURES, NoData

__all__ = ["FIGURES", "CAPTIONS", "NoData", "Outcome", "draw_all"]
# Report order; a figure not listed here follows, in registration order.
ORDER = ("throughput", "mfu", "speedup", "scaling", "orchestration", "reorder", "preprocess", "interleaving",
         "map", "loss", "timeline", "machine_speed")


@dataclass
class Outcome:
    name: str
    caption: str
    path: Path | None = None     # the PNG, when drawn
    skipped: str | None = None   # why not, when its data is absent


def draw_all(data: Results, out_dir: Path | str) -> list[Outcome]:
    """Draw every registered figure into out_dir/<name>.png; a stale PNG of a skipped one is removed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    names = [n for n in ORDER if n in FIGURES] + [n for n in FIGURES if n not in ORDER]
    for name in names:
        draw = FIGURES[name]
        path = out_dir / f"{name}.png"
        try:
            fig = draw(data)
        except NoData as why:
            path.unlink(missing_ok=True)
            outcomes.append(Outcome(name, CAPTIONS[name], skipped=str(why)))
            continue
        fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")
        plt.close(fig)
        outcomes.append(Outcome(name, CAPTIONS[name], path=path))
    return outcomes
