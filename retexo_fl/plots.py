"""PNG plots of a run summary: validation accuracy per round for each stage, and cumulative bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retexo_fl.summary import RunSummary


def write_plots(summary: RunSummary, out_dir: str | Path) -> list[Path]:
    """Write ``val_accuracy.png`` and ``bytes.png`` into ``out_dir``; returns their paths.

    Cumulative bytes grow by an equal share of a stage's model traffic each round and by the
    boundary exchange at the end of each stage (boundary bytes the stages do not account for, such
    as the GCN degree exchange, are counted with the first stage's).

    Args:
        summary (RunSummary): the run's summary (its ``stages`` with their ``history``).
        out_dir (str | Path): an existing folder.

    Returns:
        The two PNG paths, accuracy first.
    """
    # matplotlib only when plots are written: its import would cost every ClientApp process.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir)
    stages = summary.stages
    fig, ax = plt.subplots(figsize=(7, 4))
    per_pass = int(summary.config.get("stages", 0)) or len(stages)
    passes = len(stages) > per_pass
    for s in stages:
        for label, hist in curves(s, per_pass if passes else 0):
            ax.plot([h["round"] for h in hist], [h["val_accuracy"] for h in hist], label=label)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole (ticks at 1.5 before)
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{summary.mode} {summary.engine}: test {summary.accuracy_text()}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a centralized run's one curve has no label
        ax.legend()
    paths = [out / "val_accuracy.png"]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    xs, model, boundary, step = [0], [0.0], [0.0], 0
    extra = summary.bytes_boundary - sum(s.get("bytes_boundary", 0) for s in stages)
    for i, s in enumerate(stages):
        n = max(1, s.get("rounds_run", 0))
        for _ in range(n):
            step += 1
            xs.append(step)
            model.append(model[-1] + s.get("bytes_model", 0) / n)
            boundary.append(boundary[-1])
        xs.append(step)  # the exchange after the stage
        model.append(model[-1])
        boundary.append(boundary[-1] + s.get("bytes_boundary", 0) + (extra if i == 0 else 0))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, model, label="model updates")
    ax.plot(xs, boundary, label="boundary embeddings")
    ax.set_xlabel("round (all stages)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cumulative bytes")
    ax.set_title(f"boundary {summary.bytes_boundary:,} B, model {summary.bytes_model:,} B")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out / "bytes.png")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def curves(stage: dict[str, Any], per_pass: int = 0) -> list[tuple[str, list[dict[str, Any]]]]:
    """A stage's validation curves, labelled as the run's log names them: ``pass p stage k``
    where self-training passes follow (``per_pass`` stages each), and one curve per variant of a
    stage 0 trained twice (``first-stage auto``, whose rows name theirs).

    Args:
        stage (dict): one of the summary's ``stages`` (its ``stage`` and ``history``).
        per_pass (int, optional): the stages of a pass where the run made more than one, else 0.
            (default: :obj:`0`)
    """
    index = int(stage["stage"])
    name = f"pass {index // per_pass + 1} stage {index % per_pass}" if per_pass else f"stage {index}"
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in stage.get("history", []):
        groups.setdefault(str(row.get("first_stage", "")), []).append(row)
    return [(f"{name} ({variant})" if variant else name, rows) for variant, rows in groups.items()]
