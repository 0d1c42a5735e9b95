"""The loss plot that scripts/train.py keeps beside its checkpoints (loss.png)."""
from __future__ import annotations

import os
from pathlib import Path


def loss_plot(curve: list, history: list, path: Path) -> None:
    """Per-iteration training loss, and the evaluated train/val losses, as a PNG at `path`
    (written beside it and renamed over it: a reader never sees half a file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(curve) + 1), curve, lw=0.6, alpha=0.5, color="tab:blue", label="train (batch)")
    for key, color in (("train", "tab:blue"), ("val", "tab:orange")):
        pts = [(h["step"], h[key]) for h in history]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=f"{key} (eval)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
