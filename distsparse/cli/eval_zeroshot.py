"""Zero-shot evaluation with lm-evaluation-harness (issue 9 item 2; research/pretraining_ecosystem.md s6).

    python tools/eval_zeroshot.py MODEL --tasks wikitext,lambada_openai,sciq,arc_easy [--max-length N] [--limit N]
        [--batch-size N] [--include-path DIR] [--tokenizer DIR] [--device D] [--dtype fp32|bf16] [--online]
        [--json PATH]

MODEL is a Hugging Face folder (tools/export_hf.py's output), evaluated through lm-eval's `HFLM(pretrained=path)`,
or a project checkpoint (step directory or root), whose training model is rebuilt in memory
(distsparse.eval.load.load_model) and wrapped as `HFLM(pretrained=model)`: the way to evaluate models whose branches
are input-dependent and do not export (DESIGN decision 13). Its tokenizer is the run's `data.dir`/tokenizer unless
--tokenizer names another folder.

max_length is the training sequence length: the checkpoint's `data.seq_len`, or --max-length, which a Hugging Face
folder requires (its config does not record the training length, and lm-eval's fallback, max_position_embeddings,
would score wikitext in windows 4x longer than the model was trained on).

Offline by default: every task is built first with the hub offline, and the run stops before any model call listing
every dataset missing from the local HF cache. --online lets lm-eval download them. Local tasks: --include-path
DIR with task YAMLs (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import torch

from distsparse.report import add_json_arg, machine_info, print_table, write_json
from distsparse.eval.load import DTYPES, is_checkpoint, load_model
from distsparse.eval.lm_eval_adapter import check_tasks_offline, evaluate, load_task_manager, make_lm

DEFAULT_TASKS = "wikitext,lambada_openai,sciq,arc_easy"
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="Hugging Face folder, checkpoint directory or checkpoint root")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma-separated lm-eval tasks (default {DEFAULT_TASKS})")
    p.add_argument("--max-length", type=int, default=None,
                   help="context window in tokens (default: the checkpoint's data.seq_len; required for HF folders)")
    p.add_argument("--limit", type=int, default=None, help="first N documents of each task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-fewshot", type=int, default=0)
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="folder of local task YAML files (repeatable)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: the model's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--bootstrap-iters", type=int, default=1000, help="lm-eval's stderr bootstraps (0: none)")
    p.add_argument("--online", action="store_true", help="let lm-eval download missing datasets")
    add_json_arg(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ValueError(f"--tasks: got {args.tasks!r}; allowed: a comma-separated list of task names")
    for key in ("batch_size", "limit", "max_length"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')}: got {value}; allowed: >= 1")
    path = Path(args.model)
    hf_folder = not is_checkpoint(path) and (path / "config.json").is_file()
    if hf_folder and args.max_length is None:
        raise ValueError(f"--max-length: required for the Hugging Face folder {str(path)!r} (it does not record the "
                         "training sequence length); pass the run's data.seq_len, e.g. 256")
    # Tasks first: a missing dataset fails before any model is loaded.
    manager = load_task_manager(tasks, args.include_path)
    if not args.online:
        check_tasks_offline(manager, tasks)
    if hf_folder:
        lm = make_lm(path, max_length=args.max_length, tokenizer=args.tokenizer, batch_size=args.batch_size,
                     device=args.device, dtype=HF_DTYPES[args.dtype])
        source, max_length = "hf", args.max_length
    else:
        loaded = load_model(path)
        max_length = args.max_length or loaded.seq_len
        tokenizer = args.tokenizer or loaded.tokenizer_dir
        if tokenizer is None:
            raise ValueError(f"--tokenizer: required for {str(path)!r}: the run's data directory has no tokenizer/")
        model = loaded.model.to(args.device, DTYPES[args.dtype])
        lm = make_lm(model, max_length=max_length, tokenizer=tokenizer, batch_size=args.batch_size)
        source = loaded.source
    results = evaluate(lm, manager, tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                       bootstrap_iters=args.bootstrap_iters, offline=not args.online)
    config = {"model": str(path), "source": source, "tasks": tasks, "max_length": max_length, "limit": args.limit,
              "num_fewshot": args.num_fewshot, "batch_size": args.batch_size, "device": args.device,
              "dtype": args.dtype, "include_path": args.include_path, "offline": not args.online,
              "lm_eval": importlib.metadata.version("lm_eval")}
    return {"machine": machine_info(), "config": config, "results": results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        payload = run(args)
    except ValueError as err:   # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, payload)
    rows = [[task, metric, value] for task, metrics in payload["results"].items() for metric, value in metrics.items()]
    print(f"\n{payload['config']['model']} ({payload['config']['source']}), max_length "
          f"{payload['config']['max_length']}, {payload['config']['num_fewshot']}-shot")
    print_table(["task", "metric", "value"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
