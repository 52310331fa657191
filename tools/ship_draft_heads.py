"""Copy trained Medusa heads or a CTC draft module into the package (bfloat16 weights: half the
size), where ``method="medusa"`` / ``method="ctc"`` finds them for their target without ``heads=``.

    python tools/ship_draft_heads.py bench-out/heads/gemma-ctc gemma-3-270m-ctc --tree-nodes 24
"""

import argparse
from pathlib import Path

import torch

from speculum.heads import BUNDLED, FORMAT, VERSION, WEIGHTS
from speculum.heads.checkpoint import load_checkpoint, save_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a directory from `speculum train medusa|ctc-drafter --out`")
    ap.add_argument("name", help="the shipped directory's name (target alias and kind)")
    ap.add_argument("--tree-nodes", type=int, help="the draft tree size to recommend (chosen on tuning prompts)")
    args = ap.parse_args()
    config, tensors = load_checkpoint(args.checkpoint, WEIGHTS, FORMAT, VERSION, "draft-head")
    config.pop("weights_sha256")
    if args.tree_nodes:
        config.setdefault("inference", {})["tree_nodes"] = args.tree_nodes
    save_checkpoint(BUNDLED / args.name, WEIGHTS, tensors, config, dtype=torch.bfloat16)
    print(f"shipped {args.checkpoint} ({config['kind']}) as {BUNDLED / args.name}")


if __name__ == "__main__":
    main()
