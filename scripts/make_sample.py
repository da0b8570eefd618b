"""Generate a small realistic image dataset (class folders, ImageNet-like size mix, odd files).

usage: python scripts/make_sample.py OUT [--images 240] [--classes 8] [--seed 0]
"""

from __future__ import annotations

import argparse

from shardkit.synthetic import make_sample_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--images", type=int, default=240)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = make_sample_dataset(args.out, images=args.images, classes=args.classes, seed=args.seed)
    print(f"wrote {args.images} images (+1 corrupt file) in {args.classes} classes to {out}")


if __name__ == "__main__":
    main()
