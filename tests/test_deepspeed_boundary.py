"""DeepSpeed in one place: outside distsparse/train/deepspeed/ no module of the library, the launchers, the tools
or the benchmarks imports DeepSpeed's internals or reads them off its objects.

Public, and allowed anywhere: `import deepspeed`, `deepspeed.initialize`, `deepspeed.init_distributed` (with its
`deepspeed.constants` default timeout), `deepspeed.__version__`, and the engine used as a module (forward,
train/eval, device). Everything else (deepspeed.runtime, deepspeed.utils, the ZeRO optimizer's partitions and
flags, the engine's checkpoint calls, counters and scheduler) is the DeepSpeed side's to touch.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("distsparse", "launch", "tools", "bench")
SIDE = "distsparse/train/deepspeed/"
PUBLIC = {"initialize", "init_distributed", "constants", "__version__"}
# Attribute names of deepspeed==0.19.8's engine and ZeRO optimizer that only the side reads.
INTERNAL = {
    "averaged_gradients", "bit16_groups", "single_partition_of_fp32_groups", "_hp_optimizer_states_linked",
    "_lazy_init_hp_params_optimizer_state", "scaled_global_norm", "check_overflow", "check_grad_overflow",
    "clip_grad", "loss_scale", "cpu_offload", "overflow", "_get_ckpt_name", "_get_zero_ckpt_name",
    "save_non_zero_checkpoint", "save_zero_checkpoint", "global_steps", "global_samples", "was_step_applied",
    "is_gradient_accumulation_boundary", "safe_get_full_fp32_param", "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_optimizer_state",
}
# Read off a DeepSpeed engine (a name ending in `engine`): its wrapped optimizer, checkpoint calls, scheduler.
ENGINE_INTERNAL = {"optimizer", "load_checkpoint", "save_checkpoint", "lr_scheduler"}


def _base_name(node: ast.expr) -> str:
    """`a.b.engine` -> engine, `engine` -> engine."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def offences(source: str) -> list[tuple[int, str]]:
    """(line, what) for each DeepSpeed internal the source imports or reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.startswith("deepspeed.") and a.name.split(".")[1] not in PUBLIC]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            names = [a.name for a in node.names]
            if node.module == "deepspeed":
                found += [(node.lineno, f"from deepspeed import {n}") for n in names if n not in PUBLIC]
            elif node.module.split(".")[1] not in PUBLIC:
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "deepspeed" and node.attr not in PUBLIC:
                found.append((node.lineno, f"deepspeed.{node.attr}"))
            elif node.attr in INTERNAL:
                found.append((node.lineno, f".{node.attr}"))
            elif node.attr in ENGINE_INTERNAL and _base_name(node.value).endswith("engine"):
                found.append((node.lineno, f"{_base_name(node.value)}.{node.attr}"))
    return sorted(found)


def test_nothing_outside_the_deepspeed_side_reads_deepspeed_internals():
    hits = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(SIDE):
                continue
            hits += [f"{rel}:{line}: {what}" for line, what in offences(path.read_text())]
    assert not hits, "DeepSpeed internals outside distsparse/train/deepspeed/:\n" + "\n".join(hits)


def test_the_check_finds_internal_imports_and_reads():
    """The scanner itself: every kind of offence is found with its line, the public entry points are not."""
    source = "\n".join([
        "import deepspeed",
        "from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer",
        "from deepspeed import initialize, zero",
        "import deepspeed.utils",
        "deepspeed.init_distributed(dist_backend='gloo')",
        "deepspeed.comm.barrier()",
        "grads = opt.averaged_gradients",
        "state = trainer.engine.optimizer.state",
        "ds_engine.load_checkpoint('d', tag='t')",
        "from deepspeed.constants import default_pg_timeout",
        "torch.optim.lr_scheduler.LambdaLR",
    ])
    assert offences(source) == [
        (2, "from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer"), (3, "from deepspeed import zero"),
        (4, "import deepspeed.utils"), (6, "deepspeed.comm"), (7, ".averaged_gradients"), (8, "engine.optimizer"),
        (9, "ds_engine.load_checkpoint")]


def test_the_side_itself_is_where_the_internals_are():
    """The fence is where the internals went: the side's package reads them (else the scan above proves nothing)."""
    side = [what for path in sorted((ROOT / SIDE).glob("*.py")) for _, what in offences(path.read_text())]
    assert any(w.startswith("from deepspeed.runtime") for w in side)
    assert {".averaged_gradients", ".bit16_groups", "._get_ckpt_name", "engine.load_checkpoint"} <= set(side)
