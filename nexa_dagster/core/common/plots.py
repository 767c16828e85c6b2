"""Small plots a person looks at in the UI (rendered to PNG; embedded in Markdown metadata)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence


def loss_curve_png(
    curve: Sequence[tuple[int, float]], title: str, validation_loss: float | None = None
) -> bytes:
    import matplotlib  # seconds to import, only when a curve is drawn: not at the code location's load

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes the backend chosen before it loads

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    steps = [s for s, _ in curve]
    ax.plot(steps, [v for _, v in curve], marker="o", markersize=3, label="train loss")
    if validation_loss is not None and steps:
        ax.axhline(
            validation_loss, color="tab:orange", linestyle="--", label=f"validation {validation_loss:.3f}"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    """Markdown that shows the image inline in the Dagster UI's metadata panel."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"
