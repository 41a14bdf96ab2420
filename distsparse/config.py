"""One config object per run: a tree of dataclasses built from YAML plus `key=value` overrides.

This module is the schema; distsparse.strict_config builds it, and an unknown key or a value of the wrong type
fails there with a message naming the key, the value and what is allowed. Each section checks its values in
`__post_init__`; `validate(cfg, ...)` (distsparse.train.validate) runs the cross-section checks that need the
data directory or the DeepSpeed config, all before any process group starts.

Presets: `model: {preset: 60m}` loads configs/model/60m.yaml, `method: {preset: chts24_1of4_row}` loads
configs/method/chts24_1of4_row.yaml; keys given next to `preset` override the file. The configs are package data
(distsparse/configs; `configs/` in a checkout is a link to it), so an installed wheel finds them too.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distsparse.layers.dense_latent import LatentParams
from distsparse.nm import NMSpec
from distsparse.optim.grad_buckets import BUCKET_BYTES, check_grad_accum_mode
from distsparse.optim.matrix_state import RESET_MODES
from distsparse.optim.rules import RULES as RULE_REGISTRY
from distsparse.strict_config import build_dataclass, build_settings, deep_merge, parse_override, read_yaml_file
from distsparse.topology import RefreshParams

CONFIG_ROOT = Path(str(importlib.resources.files("distsparse") / "configs"))
BACKBONE_MODES = ("sparse", "dense", "ste", "srste", "cast")
RULES = tuple(RULE_REGISTRY)
DTYPES = ("fp32", "bf16", "auto")
BRANCH_KINDS = ("none", "add", "add_align", "prod_gate", "como")
PERMUTATION_MODES = ("none", "identity", "random", "learned")
BUDGET_COUNTS = ("all", "low_rank")
WANDB_MODES = ("disabled", "online", "offline")


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: got {value!r}; allowed: {', '.join(map(str, allowed))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    if not math.isfinite(value):   # nan passes both comparisons below; inf is no learning rate or interval
        raise ValueError(f"{key}: got {value!r}; allowed: a finite number {bound}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key}: got {value!r}; allowed: a number {bound}")


def check_backbone_shapes(model: "ModelConfig", method: "MethodConfig") -> None:
    """The N:M shape rule (DESIGN decision 9) for every backbone matrix of the model. The matrices are [hidden,
    hidden], [ffn, hidden] and [hidden, ffn] (FFN width rounded to model.ffn_multiple_of), so each width is the
    reduction width of some matrix: row-wise and block-wise alike need both to be multiples of M. An input
    permutation permutes both widths (every projection's input) in blocks of method.permutation.block_size."""
    perm, d, ff = method.permutation, model.hidden_size, model.ffn_width
    if perm.mode != "none" and (d % perm.block_size or ff % perm.block_size):
        raise ValueError(f"method.permutation.block_size: got {perm.block_size} with model.hidden_size {d} and FFN "
                         f"width {ff} (model.intermediate_size rounded to ffn_multiple_of); allowed: a divisor of "
                         f"both, e.g. {math.gcd(d, ff)}")
    spec = method.spec
    if spec is None:
        return
    spec.check_shape(model.hidden_size, model.hidden_size, name="model.hidden_size")
    spec.check_shape(model.ffn_width, model.ffn_width, name="model.intermediate_size (rounded to ffn_multiple_of)")


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "tiny"
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 1024
    ffn_multiple_of: int = 8           # DESIGN decision 9: sparse runs round the FFN width up to this
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    vocab_size: int = 0                # 0: taken from the data's meta.json
    activation_checkpointing: bool = False
    meta_device_init: bool = False     # build on the meta device, materialize compressed values directly

    def __post_init__(self) -> None:
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings", "ffn_multiple_of"):
            _positive(f"model.{key}", getattr(self, key))
        for key in ("rms_norm_eps", "initializer_range"):
            _positive(f"model.{key}", getattr(self, key), allow_zero=True)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size: got {self.hidden_size}; allowed: a multiple of "
                             f"model.num_attention_heads ({self.num_attention_heads})")
        head_dim = self.hidden_size // self.num_attention_heads
        if head_dim % 2:   # RoPE rotates pairs of dimensions (transformers refuses odd head dims too)
            heads = self.num_attention_heads
            raise ValueError(f"model.hidden_size: got {self.hidden_size} with model.num_attention_heads {heads}, "
                             f"a head dimension of {head_dim}; allowed: an even head dimension (RoPE rotates "
                             f"pairs), e.g. hidden_size {(head_dim - 1) * heads} or {(head_dim + 1) * heads}")

    @property
    def ffn_width(self) -> int:
        m = self.ffn_multiple_of
        return -(-self.intermediate_size // m) * m


@dataclass(kw_only=True)
class TopologyConfig:
    enabled: bool = False
    update_interval: int = 100
    t_end_fraction: float = 0.75       # masks frozen after t_end_fraction * total steps
    args: dict = field(default_factory=dict)   # RefreshParams fields (distsparse.topology)

    def __post_init__(self) -> None:
        _positive("method.topology.update_interval", self.update_interval)
        if not 0 < self.t_end_fraction <= 1:
            raise ValueError(f"method.topology.t_end_fraction: got {self.t_end_fraction}; allowed: (0, 1]")
        self.params  # checks args

    @property
    def params(self) -> RefreshParams:
        """`args` as typed refresh parameters."""
        return build_settings(RefreshParams, self.args, "method.topology.args")


@dataclass(kw_only=True)
class BranchConfig:
    kind: str = "none"
    budget_percent: float = 0.0        # of the whole dense model at reference vocab 32000; 0: use `rank`
    budget_counts: str = "all"         # all: every trainable branch parameter; low_rank: A and B only (App. H.5)
    rank: int = 0
    hidden: int = 2
    gamma: float = 0.5

    def __post_init__(self) -> None:
        _choice("method.branch.kind", self.kind, BRANCH_KINDS)
        _choice("method.branch.budget_counts", self.budget_counts, BUDGET_COUNTS)
        _positive("method.branch.budget_percent", self.budget_percent, allow_zero=True)
        if self.kind != "none" and self.budget_percent == 0 and self.rank <= 0:
            raise ValueError(f"method.branch: kind {self.kind!r} needs budget_percent > 0 or rank > 0")


@dataclass(kw_only=True)
class PermutationConfig:
    """ShuffleSparse input permutations (DESIGN s5): q/k/v share one, gate/up share one, o and down own one."""
    mode: str = "none"                 # none | identity | random | learned
    block_size: int = 64
    lambda_max: float = 1.0e-4         # penalty weight, ramped linearly over T_perm (seed Alg. 1 line 590)
    t_perm_fraction: float = 0.5       # T_perm = fraction * total steps: every block hard by then
    delta: float = 0.22                # per-row penalty under which a block hardens (seed App. F, ViT-B/16)
    check_interval: int = 10           # steps between hardening checks

    def __post_init__(self) -> None:
        _choice("method.permutation.mode", self.mode, PERMUTATION_MODES)
        _positive("method.permutation.block_size", self.block_size)
        _positive("method.permutation.lambda_max", self.lambda_max, allow_zero=True)
        _positive("method.permutation.check_interval", self.check_interval)
        if not 0 < self.t_perm_fraction <= 1:
            raise ValueError(f"method.permutation.t_perm_fraction: got {self.t_perm_fraction}; allowed: (0, 1]")


@dataclass(kw_only=True)
class MethodConfig:
    preset: str = ""
    name: str = "chts24"
    sparsity: str = "1:4"              # none | 1:4 | 2:4 | 3:4
    layout: str = "row"                # row | block
    backbone: str = "sparse"           # sparse (compressed values) | dense | ste | srste | cast (dense latents)
    init: str = "swi"                  # swi | hf
    rule: str = "adam"                 # backbone update rule, run by the matrix engine
    lr: float = 1e-3                   # backbone peak learning rate (the dense side uses train.lr)
    rule_args: dict = field(default_factory=dict)   # HParams fields of the rule (distsparse.optim), but lr
    latent_args: dict = field(default_factory=dict)  # LatentParams fields (srste/cast baselines)
    reset_mode: str = "changed"        # rule state of refreshed links: changed | all | none (paper Table A8)
    # The branch's own DeepSpeed parameter group (issue 28): its peak rate on the dense side's schedule, and its
    # weight decay. null: train.lr / train.weight_decay in the dense side's one group, the paper's coupling.
    branch_lr: float | None = None
    branch_weight_decay: float | None = None
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    branch: BranchConfig = field(default_factory=BranchConfig)
    permutation: PermutationConfig = field(default_factory=PermutationConfig)

    def __post_init__(self) -> None:
        _choice("method.backbone", self.backbone, BACKBONE_MODES)
        _choice("method.rule", self.rule, RULES)
        _choice("method.init", self.init, ("swi", "hf"))
        _choice("method.reset_mode", self.reset_mode, RESET_MODES)
        _positive("method.lr", self.lr)
        self._check_branch_group()
        self.rule_params  # checks rule_args against the rule's hyperparameters
        self.latent_params  # checks latent_args and that each applies to the backbone
        if self.reset_mode != "changed" and not (self.topology.enabled and self.backbone == "sparse"):
            raise ValueError(f"method.reset_mode: got {self.reset_mode!r} with method.backbone {self.backbone!r} and "
                             f"method.topology.enabled {self.topology.enabled}; allowed: 'changed' (the default), "
                             f"or another mode only with refreshes of a sparse backbone (it acts on refreshes)")
        if self.sparsity == "none":
            if self.backbone != "dense":
                raise ValueError(f"method.sparsity: got 'none' with method.backbone {self.backbone!r}; "
                                 f"allowed: sparsity 'none' only with backbone 'dense'")
            if self.topology.enabled:
                raise ValueError("method.topology.enabled: got True with method.sparsity 'none'; "
                                 "allowed: topology refreshes only on sparse backbones")
        else:
            self.spec  # parses and validates sparsity and layout
            if self.backbone == "dense":
                raise ValueError(f"method.backbone: got 'dense' with method.sparsity {self.sparsity!r}; "
                                 f"allowed: 'dense' only with sparsity 'none'")

    def _check_branch_group(self) -> None:
        for key, allow_zero in (("branch_lr", False), ("branch_weight_decay", True)):
            value = getattr(self, key)
            if value is None:
                continue
            if self.branch.kind == "none":
                raise ValueError(f"method.{key}: got {value!r} with method.branch.kind 'none'; allowed: null (a "
                                 f"method without a branch has no branch parameter group)")
            _positive(f"method.{key}", value, allow_zero=allow_zero)

    @property
    def separate_branch_group(self) -> bool:
        """True when the branch parameters get their own DeepSpeed parameter group (a rate or decay of their own)."""
        return separate_branch_group(dataclasses.asdict(self))

    @property
    def rule_params(self) -> Any:
        """The backbone rule's hyperparameters (distsparse.optim.hparams), lr = method.lr."""
        return build_settings(RULE_REGISTRY[self.rule].hparams, self.rule_args, "method.rule_args", lr=self.lr)

    @property
    def latent_params(self) -> LatentParams:
        """Options of the dense-latent baselines; a key that does not apply to method.backbone is refused."""
        params = build_settings(LatentParams, self.latent_args, "method.latent_args")
        for name in self.latent_args:
            modes = LatentParams.MODES_OF[name]
            if self.backbone not in modes:
                raise ValueError(f"method.latent_args.{name}: got {self.latent_args[name]!r} with method.backbone "
                                 f"{self.backbone!r}; allowed: only with backbone {', '.join(modes)}")
        return params

    @property
    def spec(self) -> NMSpec | None:
        if self.sparsity == "none":
            return None
        try:
            return NMSpec.parse(self.sparsity, self.layout)
        except ValueError as err:
            raise ValueError(f"method.{err}") from None


@dataclass(kw_only=True)
class DataConfig:
    dir: str = "data/stdlib"
    seq_len: int = 256

    def __post_init__(self) -> None:
        _positive("data.seq_len", self.seq_len)


@dataclass(kw_only=True)
class EngineConfig:
    mode: str = "sharded"              # sharded (owners) | replicated (all-reduce, the oracle)
    reduce_dtype: str = "fp32"         # fp32 | bf16
    # full: a W x shard fp32 buffer per rank, one reduce per step; sharded: an accumulator of the rank's own
    # gradients, one reduce per micro-batch; auto: sharded with one micro-batch per step or W > 2, else full
    # (distsparse/optim/grad_buckets.py)
    grad_accum_mode: str = "auto"
    num_buckets: int = 4               # full mode: > 1 lets each bucket's reduce overlap the rest of the backward
    bucket_bytes: int = BUCKET_BYTES   # sharded mode: the fp32 staging of one bucket, at most (a larger matrix alone)
    force_collectives: bool = False    # test-only: run the backbone collectives at world size 1 (GPU check)

    def __post_init__(self) -> None:
        _choice("engine.mode", self.mode, ("sharded", "replicated"))
        _positive("engine.num_buckets", self.num_buckets)
        _positive("engine.bucket_bytes", self.bucket_bytes)
        _choice("engine.reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        check_grad_accum_mode(self.grad_accum_mode, replicated=self.mode == "replicated")


@dataclass(kw_only=True)
class OptimConfig:
    # torch.compile the matrix engine's group kernels (distsparse/optim/group_rules.py): the same numbers; off until
    # a GPU run shows it pays (compiling costs tens of seconds per group shape on CPU)
    compile: bool = False


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100                   # optimizer steps
    micro_batch: int = 8               # sequences per rank per micro-step
    # sequences per optimizer step, all ranks; accumulation = global / (micro_batch x world size), and a resume on
    # another world size keeps it. 0: micro_batch x grad_accum x world size (distsparse/train/batch.py)
    global_batch_size: int = 0
    grad_accum: int = 1                # micro-steps per optimizer step; with global_batch_size set: 1 = derived
    lr: float = 3e-3                   # dense side (DeepSpeed AdamW) peak learning rate
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0             # joint norm over DeepSpeed and backbone gradients; 0 disables
    dtype: str = "auto"                # auto: bf16 on GPU, fp32 on CPU
    seed: int = 0
    eval_interval: int = 50
    eval_samples: int = 256            # validation sequences per evaluation (0: all)
    log_interval: int = 10
    out_dir: str = "runs/default"

    def __post_init__(self) -> None:
        for key in ("steps", "micro_batch", "grad_accum", "log_interval", "eval_interval"):
            _positive(f"train.{key}", getattr(self, key))
        _positive("train.lr", self.lr)
        _positive("train.grad_clip", self.grad_clip, allow_zero=True)
        _positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("train.global_batch_size", self.global_batch_size, allow_zero=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio: got {self.min_lr_ratio}; allowed: [0, 1]")
        for key in ("beta1", "beta2"):   # AdamW's own check would fire inside DeepSpeed, after the process group
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"train.{key}: got {getattr(self, key)}; allowed: [0, 1)")
        _positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _positive("train.eval_samples", self.eval_samples, allow_zero=True)
        _choice("train.dtype", self.dtype, DTYPES)


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""                      # "": <train.out_dir>/checkpoints
    interval: int = 0                  # steps between saves; 0: on preemption (and at the end if resume is set)
    keep_last: int = 3
    resume: str = ""                   # "": start fresh; auto: newest complete checkpoint; or a checkpoint dir
    save_at_end: bool = True

    def __post_init__(self) -> None:
        _positive("checkpoint.interval", self.interval, allow_zero=True)
        _positive("checkpoint.keep_last", self.keep_last)


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases beside TensorBoard (rank 0). offline: files under <train.out_dir>/wandb for `wandb sync`."""
    mode: str = "disabled"
    project: str = ""
    name: str = ""                     # "": W&B's generated name

    def __post_init__(self) -> None:
        _choice("logging.wandb.mode", self.mode, WANDB_MODES)
        if self.mode != "disabled" and not self.project:
            raise ValueError(f"logging.wandb.project: got ''; allowed: a project name when logging.wandb.mode is "
                             f"{self.mode}")


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ---- loading: shipped files, presets, overrides ----------------------------------------------------------

CONFIG_MAPPING = "a YAML mapping of config sections (model, method, data, engine, train, checkpoint)"


def _expand_presets(raw: dict) -> dict:
    out = dict(raw)
    for section, folder in (("model", "model"), ("method", "method")):
        sec = out.get(section)
        if isinstance(sec, dict) and sec.get("preset"):
            path = CONFIG_ROOT / folder / f"{sec['preset']}.yaml"
            if not path.exists():
                names = sorted(p.stem for p in (CONFIG_ROOT / folder).glob("*.yaml"))
                raise ValueError(f"{section}.preset: got {sec['preset']!r}; allowed: {', '.join(names)}")
            base = read_yaml_file(path, f"{section}.preset", CONFIG_MAPPING) or {}
            out[section] = deep_merge(base, sec)
    return out


def shipped_or_given(given: str | Path, folder: str, suffix: str, option: str) -> Path:
    """The file `given` names, or the one the package ships: a bare name (`zero2`, `zero2.json`) or the
    documented relative path (`configs/ds/zero2.json`) finds configs/<folder>/ from any working directory, so an
    installed package runs the README's commands. Any other missing path is refused."""
    p = Path(given)
    if p.exists():
        return p
    name = p.name if p.name.endswith(suffix) else p.name + suffix
    documented = p.parent == Path(".") or p.parent.parts[-2:] == ("configs", folder)
    if documented and (CONFIG_ROOT / folder / name).exists():
        return CONFIG_ROOT / folder / name
    shipped = sorted(q.stem for q in (CONFIG_ROOT / folder).glob(f"*{suffix}"))
    raise ValueError(f"{option}: got {str(given)!r}; the file does not exist; allowed: a path to a file or a "
                     f"name the package ships in configs/{folder}/: {', '.join(shipped)}")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (optional; a path, or an experiment the package ships) + `key=value` overrides -> validated
    Config."""
    raw: dict = {}
    if path is not None:
        p = shipped_or_given(path, "experiments", ".yaml", "--config")
        raw = read_yaml_file(p, "--config", CONFIG_MAPPING) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"--config {p}: got a YAML {type(raw).__name__}; allowed: {CONFIG_MAPPING}")
    for item in overrides:
        raw = deep_merge(raw, parse_override(item))
    return build_dataclass(Config, _expand_presets(raw), "")


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


# Keys added to the config after runs were recorded (config.json), each with the value that does what those runs
# did: a recorded run without the key reads as one with that value, so it is still the same config.
# Sections that change no number a run computes: left out when finished runs are compared by config.
RESULT_NEUTRAL_SECTIONS = ("checkpoint", "logging")
ADDED_KEYS = {("method", "branch_lr"): None, ("method", "branch_weight_decay"): None,   # issue 28: one dense group
              ("train", "global_batch_size"): 0,   # issue 26: the global batch from micro_batch x grad_accum x world
              ("optim", "compile"): False}         # issue 25: the section, eager group kernels


def separate_branch_group(method: dict) -> bool:
    """Of a method section as config_to_dict writes it (a recorded run's too): the branch has its own group."""
    method = with_added_keys({"method": method})["method"]
    return method["branch_lr"] is not None or method["branch_weight_decay"] is not None


def with_added_keys(config: dict) -> dict:
    """A recorded config (config_to_dict's layout) with every ADDED_KEYS entry it lacks set to its value."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for (section, key), value in ADDED_KEYS.items():
        if section not in out:   # a section added since: the run had its keys at their values then
            out[section] = {}
        if isinstance(out[section], dict):
            out[section].setdefault(key, value)
    return out
