"""Copy a trained acceptance head into the package (bfloat16 weights: half the size), where
``length_policy="specdecpp"`` finds it for its draft model without ``acceptance_head=``.

    python tools/ship_acceptance_head.py heads/qwen qwen2.5-coder-0.5b
"""

import argparse
from pathlib import Path

import torch

from speculum.heads.acceptance import BUNDLED, AcceptanceHead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a directory from `speculum train acceptance-head --out`")
    ap.add_argument("name", help="the shipped head's directory name (the draft model's alias)")
    args = ap.parse_args()
    head = AcceptanceHead.load(args.checkpoint)
    head.save(BUNDLED / args.name, training=head.training_info, dtype=torch.bfloat16)
    print(f"shipped {args.checkpoint} as {BUNDLED / args.name}")


if __name__ == "__main__":
    main()
