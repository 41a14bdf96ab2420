"""Entry point: `deepspeed launch/pretrain.py --ds_config configs/ds/zero2.json --config X.yaml [key=value ...]`.

Also runs under `torchrun`, as one of `srun`'s tasks, inside launch/slurm.py's jobs and under plain `python` (one
process); distsparse/cli/launch_env.py tells them apart and refuses a multi-task launch it cannot place. Parses and
validates everything before any process group starts, then hands the run to the trainer (torchtitan's train.py
shape).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import yaml

from distsparse.cli import launch_env
from distsparse.config import config_to_dict, load_config
from distsparse.train.deepspeed.config import build_ds_config
from distsparse.train.validate import validate, validate_without_data


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run config (configs/experiments/...)")
    p.add_argument("--ds_config", default="configs/ds/zero2.json", help="DeepSpeed JSON (ZeRO-1/2)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, print parameter counts and the memory per rank by "
                        "part (distsparse/memory_estimate.py), exit; starts no process group")
    p.add_argument("--dry-run-world-size", type=int, default=None, metavar="N",
                   help="with --dry-run: plan for N ranks instead of the launch's world size (e.g. 8 or 64 GPUs "
                        "from a laptop)")
    p.add_argument("--result-json", default=None,
                   help="write the run's result (step, losses, preempted and by which signal) to this file from "
                        "each node's first process (launch/slurm.py --launcher torchrun reads it)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    args = p.parse_intermixed_args(argv)   # overrides may follow options (`--dry-run-world-size 64 a.b=1`)
    if args.dry_run_world_size is not None and (not args.dry_run or args.dry_run_world_size < 1):
        p.error(f"--dry-run-world-size: got {args.dry_run_world_size}"
                f"{'' if args.dry_run else ' without --dry-run'}; allowed: an integer >= 1, with --dry-run")
    return args


def write_result(path: str, result, received: int | None) -> None:
    """The trainer's result as JSON, written atomically (the launcher reads it after the workers exit)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {**asdict(result), "signal": signal.Signals(received).name if received else None}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, out)


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
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        env = launch_env.resolve_here()   # pure: reads the launcher's variables, starts nothing
    except launch_env.LaunchError as err:
        print(f"launch error: {err}", file=sys.stderr)
        return 2
    # A dry run is checked at the world it plans only: the batch plan valid on 64 ranks may not be on this laptop.
    world_size = args.dry_run_world_size or env.world_size
    planning_elsewhere = args.dry_run and not (Path(cfg.data.dir) / "meta.json").is_file()
    try:
        # the data checks need the global batch; a plan for data that is not here checks the config alone
        meta = validate_without_data(cfg, world_size) if planning_elsewhere else validate(cfg, world_size=world_size)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from distsparse.memory_estimate import estimate_run, format_estimate
        from distsparse.models import build_on_meta, parameter_counts
        if planning_elsewhere:
            print(f"data.dir {cfg.data.dir!r} has no meta.json here: data checks skipped, vocabulary "
                  f"{cfg.model.vocab_size} from model.vocab_size")
        # Shapes only: a 1b plan allocates nothing model-sized.
        model = build_on_meta(cfg.model, cfg.method, cfg.model.vocab_size or meta["vocab_size"], cfg.train.seed)
        for key, value in parameter_counts(model).items():
            print(f"{key:28s} {value:>14,d}" if isinstance(value, int) else f"{key:28s} {value:>14.4f}")
        print(format_estimate(estimate_run(model, cfg, ds_config, world_size)))
        return 0

    device = launch_env.start(env)   # the GPU is chosen, then the process group starts on it
    if env.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    logging.info(launch_env.describe(env, device))
    from distsparse.checkpoint import CheckpointError
    from distsparse.train.trainer import Trainer
    try:
        trainer = Trainer(cfg, ds_config)
    except CheckpointError as err:   # a digest the ranks found wrong (find is collective: every rank is here)
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 2
    try:
        result = trainer.train()
        received = trainer.preemption.received
    finally:
        trainer.close()
    if args.result_json and env.local_rank == 0:
        write_result(args.result_json, result, received)
    return 0


if __name__ == "__main__":
    sys.exit(main())
