"""Entry point: `deepspeed launch/pretrain.py --ds_config configs/ds/zero2.json --config X.yaml [key=value ...]`.

Also runs under `torchrun` and plain `python` (one process). Parses and validates everything before any
process group starts, then hands the run to the trainer (torchtitan's train.py shape).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

import yaml

from distsparse.config import config_to_dict, load_config
from distsparse.train.ds_config import build_ds_config
from distsparse.train.validate import validate


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run config (configs/experiments/...)")
    p.add_argument("--ds_config", default="configs/ds/zero2.json", help="DeepSpeed JSON (ZeRO-1/2)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dry-run", action="store_true", help="build the model, print parameter counts, exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    return p.parse_args(argv)


def _single_process_env() -> None:
    """Plain `python`: a world of one on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = load_config(args.config, args.overrides)
        ds_config = build_ds_config(args.ds_config, cfg)
        if args.print_config:
            print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            print(json.dumps(ds_config, indent=2))
            return 0
        meta = validate(cfg)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from distsparse.models import build_model, parameter_counts
        model = build_model(cfg.model, cfg.method, cfg.model.vocab_size or meta["vocab_size"], cfg.train.seed)
        for key, value in parameter_counts(model).items():
            print(f"{key:28s} {value:>14,d}")
        return 0

    import deepspeed
    import torch
    _single_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
    from distsparse.train.trainer import Trainer
    trainer = Trainer(cfg, ds_config)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
