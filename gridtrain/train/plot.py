"""`gridtrain plot RUN_DIR`: loss (train and validation) and throughput curves as a PNG."""

from __future__ import annotations

from pathlib import Path

from gridtrain.errors import BadInput
from gridtrain.train.metrics import read_metrics


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    records = read_metrics(run_dir)  # first: matplotlib writes its font cache when imported
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss/train" in r]
    val = [r for r in records if "loss/val" in r]
    if not train and not val:
        raise BadInput(f"{run_dir}/metrics.jsonl has no loss records to plot")
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_loss.plot([r["step"] for r in train], [r["loss/train"] for r in train], label="train", lw=1)
    ax_loss.plot([r["step"] for r in val], [r["loss/val"] for r in val], "o-", label="validation")
    ax_loss.set(xlabel="optimizer step", ylabel="loss (nats/token)", title="loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    steps = [r["step"] for r in train]
    ax_tput.plot(steps, [r["throughput/tokens_per_s"] for r in train], lw=1, color="tab:green")
    ax_tput.set(xlabel="optimizer step", ylabel="tokens/s", title="throughput")
    ax_tput.grid(alpha=0.3)
    if train and "mfu_pct" in train[0]:
        ax_mfu = ax_tput.twinx()
        ax_mfu.plot(steps, [r["mfu_pct"] for r in train], lw=0.8, color="tab:purple", alpha=0.6)
        ax_mfu.set_ylabel("MFU %", color="tab:purple")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = out or run_dir / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
