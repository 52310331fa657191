"""Recipe sweep for the SpecDec++ acceptance head over cached training data.

Trains one head per setting (learning rate, rejection weight w_rej, depth) on the data that
``speculum train acceptance-head`` cached, for up to ``--epochs`` epochs, and reports per epoch the
validation loss under one fixed weighting (w_rej = 6, so settings trained with other weights stay
comparable), the validation AUC (how well the head ranks accepted above rejected candidates:
threshold-free, which matters because the stop threshold h is chosen afterwards) and the mean
predicted acceptance vs the observed one. Validation texts are held out by text, as in training.

    python benchmarks/acceptance_head_sweep.py bench-out/heads/qwen-0.5b/acceptance_data.safetensors \\
        --out benchmarks/results/acceptance-head-sweep.md
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from speculum.bench.report import machine_info, now_iso
from speculum.training.acceptance import TrainSettings, split_by_text, train_head, weighted_bce


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Probability that a random accepted candidate scores above a random rejected one (ties count half)."""
    ranks = torch.empty_like(scores)
    order = scores.argsort()
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _setting(r: dict) -> str:
    return f"lr {r['lr']:g}, w_rej {r['w_rej']:g}, depth {r['depth']}, {r['variant']} head, epoch {r['epoch']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path)
    ap.add_argument("--lr", default="3e-3,1e-3,3e-4,1e-4")
    ap.add_argument("--w-rej", default="6")
    ap.add_argument("--depth", default="3")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument(
        "--variants",
        default="paper,confidence,early",
        help="paper (hidden state where the candidate is the input), confidence (and the draft's "
        "confidence in it), early (the state that produced it, and the confidence)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    data = load_file(str(args.data))
    _, val = split_by_text(data, 0.1, 0)
    y = data["label"][val]
    x = data["hidden"][val].float()
    q = data["confidence"][val] if "confidence" in data else None
    before = data["hidden_before"][val].float() if "hidden_before" in data else None
    base_rate = float(y.mean())
    rows = []
    grid = itertools.product(
        [float(v) for v in args.lr.split(",")], [float(v) for v in args.w_rej.split(",")],
        [int(v) for v in args.depth.split(",")], args.variants.split(","),
    )  # fmt: skip
    for lr, w_rej, depth, variant in grid:
        reads, early = variant != "paper", variant == "early"
        settings = TrainSettings(depth=depth, w_rej=w_rej, epochs=1, lr=lr, confidence_input=reads, early=early)
        with tempfile.TemporaryDirectory() as tmp:
            for epoch in range(1, args.epochs + 1):
                settings.epochs = epoch
                t0 = time.perf_counter()
                head, _ = train_head(data, settings, Path(tmp), resume=epoch > 1, progress=False, log=lambda *_: None)
                with torch.no_grad():
                    logits = head(before if early else x, q if reads else None)
                row = {
                    "lr": lr, "w_rej": w_rej, "depth": depth, "variant": variant, "epoch": epoch,
                    "val_loss_w6": float(weighted_bce(logits, y, 6.0)),
                    "val_auc": auc(logits, y > 0.5),
                    "mean_pred": float(torch.sigmoid(logits).mean()),
                    "seconds": time.perf_counter() - t0,
                }  # fmt: skip
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    best = min(rows, key=lambda r: r["val_loss_w6"])
    reference = f"; AUC of the draft's confidence alone {auc(q, y > 0.5):.4f}" if q is not None else ""
    best_auc = max(rows, key=lambda r: r["val_auc"])
    lines = [
        "# Acceptance-head recipe sweep (validation texts held out)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {now_iso()}; machine: {machine_info()['cpu']}",
        f"- data: {len(data['label'])} candidate positions, {len(y)} of them validation; observed mean label "
        f"(validation) {base_rate:.3f}{reference}",
        f"- lowest validation loss: {_setting(best)} ({best['val_loss_w6']:.4f}); "
        f"highest AUC: {_setting(best_auc)} ({best_auc['val_auc']:.4f})",
        "",
        "| lr | w_rej | depth | head | epoch | validation loss (w_rej 6) | validation AUC | "
        "mean predicted acceptance |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['w_rej']:g} | {r['depth']} | {r['variant']} | {r['epoch']} | "
            f"{r['val_loss_w6']:.4f} | {r['val_auc']:.4f} | {r['mean_pred']:.3f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    main()
