"""Plot a run's metrics: `python scripts/plot_metrics.py OUTPUT_DIR` reads OUTPUT_DIR/metrics.jsonl and writes
one PNG per panel, plus all panels in overview.png, under OUTPUT_DIR/plots/.

A panel whose keys the run never logged (no validation, say) is skipped. Validation values are points at the steps
they were taken (step 0 = before training); training values are lines.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node
import matplotlib.pyplot as plt  # noqa: E402

# file name, title, y label, [(metric key, legend label, is validation)]
PANELS = [
    ("reward", "reward", "overall", [("reward/overall", "train", False), ("val/overall", "val", True)]),
    ("accuracy", "accuracy", "accuracy", [("reward/accuracy", "train", False), ("val/accuracy", "val", True)]),
    ("kl", "KL to the reference", "KL per token", [("actor/kl", "train", False)]),
    ("entropy", "entropy", "nats per token", [("actor/entropy", "train", False)]),
    ("response_length", "response length", "tokens",
     [("response_length/mean", "train mean", False), ("response_length/max", "train max", False),
      ("val/response_length", "val mean", True)]),
    ("grad_norm", "gradient norm (before clipping)", "L2 norm", [("actor/grad_norm", "train", False)]),
    ("throughput", "throughput", "tokens/s",
     [("perf/tokens_per_s_per_device", "per device, whole step", False),
      ("perf/rollout_tokens_per_s", "generated, all ranks", False)]),
]  # fmt: skip


def read_metrics(path: str) -> list[dict]:
    """Rows by step; a step logged twice (a run resumed without truncation) keeps its last row."""
    rows = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # the last line of a killed run may be cut short
                continue
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return [rows[s] for s in sorted(rows)]


def draw(ax, rows, title, ylabel, series) -> bool:
    """Draw one panel; False when none of its keys was logged."""
    drawn = False
    for key, label, is_val in series:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            continue
        steps, values = zip(*points)
        ax.plot(steps, values, "o--" if is_val else "-", label=label, markersize=4)
        drawn = True
    if drawn:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return drawn


def plot_metrics(output_dir: str) -> list[str]:
    """Write the PNGs; returns their paths."""
    rows = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    plot_dir = os.path.join(output_dir, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    written, present = [], []
    for name, title, ylabel, series in PANELS:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        if draw(ax, rows, title, ylabel, series):
            path = os.path.join(plot_dir, f"{name}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            written.append(path)
            present.append((title, ylabel, series))
        plt.close(fig)
    if present:
        cols = min(3, len(present))
        nrows = (len(present) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.2 * nrows), squeeze=False)
        for ax, (title, ylabel, series) in zip(axes.flat, present):
            draw(ax, rows, title, ylabel, series)
        for ax in list(axes.flat)[len(present) :]:
            ax.axis("off")
        fig.tight_layout()
        path = os.path.join(plot_dir, "overview.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(argv[0], "metrics.jsonl")):
        print(f"no metrics.jsonl in {argv[0]!r}: pass a run's trainer.output_dir", file=sys.stderr)
        return 2
    for path in plot_metrics(argv[0]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
