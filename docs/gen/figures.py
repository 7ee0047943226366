"""Writes the site's figures at build time (mkdocs-gen-files runs it), from data recorded in the repository:
figures/quickstart-learning-curve.svg from docs/data/quickstart-metrics.jsonl (the `metrics.jsonl` of one `make
quickstart` run, as it was written). `learning_curve` draws it anywhere: `python docs/gen/figures.py METRICS OUT.svg`.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

METRICS = Path(__file__).resolve().parents[1] / "data" / "quickstart-metrics.jsonl"


def learning_curve(metrics: Path) -> str:
    """The training reward of every step and the held-out accuracy of every evaluation, as an SVG (the same bytes
    for the same file: no date, fixed ids)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    plt.rcParams.update({"svg.hashsalt": "distrl", "svg.fonttype": "none", "font.size": 10})
    fig, ax = plt.subplots(figsize=(7, 3.4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward/mean"] for r in rows], marker=".", label="training reward (mean of the step's samples)")
    for key in sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")}):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        name = key.split("/")[1]
        ax.plot(*zip(*points, strict=True), marker="o", linestyle="--", label=f"held-out accuracy ({name})")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", frameon=False)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(learning_curve(Path(sys.argv[1])))
else:
    import mkdocs_gen_files

    with mkdocs_gen_files.open("figures/quickstart-learning-curve.svg", "w") as figure:
        figure.write(learning_curve(METRICS))
