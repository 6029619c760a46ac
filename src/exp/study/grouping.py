"""Which jobs of a study can share one base (`hydra.launcher.share_base=true`): jobs whose base model, quantization,
hardware, tokenised data and step shape agree train together in one process (exp.study.group_fit), each with its own
adapter, optimiser, schedule, seed and run directory. Torch-free: the launcher's process groups the jobs.

What may differ inside a group is everything that lives in a job's adapter or its optimiser: `lora.*` (rank,
alpha, dropout, targets, init seed, rsLoRA, rank / alpha patterns; DoRA, the inits other than default / gaussian
and LoRA+ run alone), `trainer.*` except the step's shape (learning rate, schedule, warmup, steps, clipping, seed,
validation and logging intervals), `data.seed` (each job's own split and order) and the logger's
run. The rest is the group's key.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from exp.core.config import LoraInit, TrainConfig
from exp.core.strategies import Strategy, strategy_traits
from exp.run.compose import config_dict

# Trainer fields every job of a group shares: the micro-batches of a step are taken in lockstep.
SHARED_TRAINER_FIELDS = ("global_batch_size",)
# Hardware fields the launcher sets per job (a placement), not part of what the base depends on.
PLACEMENT_FIELDS = ("memory_budget_gib",)


def base_key(cfg: TrainConfig) -> str:
    """Everything one shared base depends on, as a canonical string: equal keys can share a base."""
    d = config_dict(cfg)
    key = {
        "model": d["model"],
        "quantization": d["quantization"],
        "hardware": {k: v for k, v in d["hardware"].items() if k not in PLACEMENT_FIELDS},
        "data": {k: v for k, v in d["data"].items() if k != "seed"},
        "trainer": {k: d["trainer"][k] for k in SHARED_TRAINER_FIELDS},
    }
    return json.dumps(key, sort_keys=True, default=str)


def with_micro_batch(
    cfgs: list[TrainConfig], micro_batch: int, micro_batch_tokens: int | None = None
) -> list[TrainConfig]:
    """The jobs' configs with the micro-batch (and padding-free token budget) each would resolve alone (the
    preflight's choice for one of them: they share the hardware and data shape), fixed: a grouped job then takes the
    steps, micro-batches and validation batches it would take alone."""
    out = []
    for c in cfgs:
        c = copy.deepcopy(c)
        c.hardware.micro_batch_size = micro_batch
        if micro_batch_tokens is not None:
            c.hardware.micro_batch_tokens = micro_batch_tokens
        c.hardware.auto_micro_batch = False
        out.append(c)
    return out


def shared_config(cfgs: list[TrainConfig]) -> TrainConfig:
    """The config the group's base is built and planned from: the first job's, with what one base under several
    adapters cannot do switched off, and the step's rows of every job together.

    The memory is planned eager: a group compiles only the parts of its layers without adapters (the routing, a
    Python list per forward, would be a constant of every graph; exp.model.build.compile_adapter_free_parts), so a
    compiled layer's smaller saved activations are not counted (exp.study.group_worker restores the job's choice
    after the preflight). Kept weights fused with one job's LoRA would hold that job's adapter only. Padding-free
    jobs stay padding-free: their micro-batches are laid end to end in one row (exp.study.group_fit). Each job keeps
    its micro-batch and token budget (`with_micro_batch`; no auto_micro_batch: the jobs' parts must line up); the
    preflight resolves what remains `auto` (recomputed and kept-dequantized layers) for all the parts of a group
    step, so the group's choices fit the group, within the sum of the jobs' memory budgets where each sets one.
    `lora` is what the memory estimate reads (the model takes each job's own): one adapter as large as all of the
    jobs' together."""
    cfg = copy.deepcopy(cfgs[0])
    hw = cfg.hardware
    hw.compile = False
    hw.fuse_lora = False
    hw.auto_micro_batch = False
    hw.micro_batch_size = sum(c.hardware.micro_batch_size for c in cfgs)
    if hw.padding_free:
        tokens = [c.hardware.micro_batch_tokens or c.hardware.micro_batch_size * c.data.max_seq_len for c in cfgs]
        hw.micro_batch_tokens = sum(tokens)
    # Jobs that each plan for a budget plan together for the sum (the base is counted once in it: room to spare).
    budgets = [c.hardware.memory_budget_gib for c in cfgs]
    hw.memory_budget_gib = None if None in budgets else round(sum(budgets), 2)
    cfg.trainer.global_batch_size = sum(c.trainer.global_batch_size for c in cfgs)
    # The estimate's adapter stands for all of them: every job's targets at the sum of the jobs' largest ranks (an
    # upper bound where jobs target different projections). Every job's weights, gradients and AdamW state are
    # counted (8 jobs of rank 16 on every Gemma-7B projection hold 6 GB of them), and so is the stacked product's
    # saved [tokens, sum of ranks] per layer (exp.model.adapters).
    cfg.lora.target_modules = list(dict.fromkeys(t for c in cfgs for t in c.lora.target_modules))
    cfg.lora.r = sum(max([c.lora.r, *c.lora.rank_pattern.values()]) for c in cfgs)
    cfg.lora.rank_pattern, cfg.lora.alpha_pattern = {}, {}
    cfg.lora.dropout = max(c.lora.dropout for c in cfgs)  # dropout's masks and copies, if any job has them
    return cfg


def why_alone(cfg: TrainConfig) -> str | None:
    """Why this job cannot join a group (it then runs alone, as without share_base); None when it can."""
    hw = cfg.hardware
    several = hw.strategy != Strategy.auto and strategy_traits(hw.strategy).uses_several_devices
    if several or hw.devices != 1 or hw.num_nodes != 1:
        return (
            f"hardware.strategy={hw.strategy.value} on {hw.devices} device(s): a group trains in one process on one "
            "device"
        )
    if cfg.lora.modules_to_save:
        return "lora.modules_to_save: a fully trained module copy per job is not shared"
    if cfg.lora.use_dora:
        return "lora.use_dora: the shared base adds each job's plain LoRA product, and DoRA rescales the whole output"
    if cfg.lora.init not in (LoraInit.default, LoraInit.gaussian):
        return (
            f"lora.init={cfg.lora.init.value}: the init is computed from (PiSSA, OLoRA: and changes) the base weights"
        )
    if cfg.lora.plus_lr_ratio is not None:
        return "lora.plus_lr_ratio: PEFT's LoRA+ optimiser takes every trainable tensor of the model, every job's"
    if cfg.model.adapter:
        return "model.adapter: a group's adapters start fresh, this job starts from a trained one"
    if cfg.objective.preference:
        return f"objective={cfg.objective.kind.value}: a group trains the next-token loss"
    return None


@dataclass
class Group:
    """Jobs that train together over one base, in sweep order; `alone`: a single job that runs as without
    share_base (with the reason, when it could not join one)."""

    names: list[str]
    reason: str | None = None
    members: list = field(default_factory=list)  # what the caller grouped (planned jobs, launch jobs)

    @property
    def name(self) -> str:
        """The group's name in plans and journals: its first job's, with the count of the others."""
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]}+{len(self.names) - 1}"


def group_jobs(jobs: list, cfg_of, name_of, max_size: int | None = None) -> list[Group]:
    """Jobs grouped by `base_key` in sweep order (a group of one where `why_alone` says so), at most `max_size` a
    group. `cfg_of(job)` and `name_of(job)` read a job's typed config and name."""
    groups: dict[str, list[Group]] = {}
    out: list[Group] = []
    for job in jobs:
        cfg = cfg_of(job)
        if (reason := why_alone(cfg)) is not None:
            out.append(Group([name_of(job)], reason, [job]))
            continue
        key = base_key(cfg)
        open_groups = groups.setdefault(key, [])
        if not open_groups or (max_size is not None and len(open_groups[-1].names) >= max_size):
            g = Group([], None, [])
            open_groups.append(g)
            out.append(g)
        open_groups[-1].names.append(name_of(job))
        open_groups[-1].members.append(job)
    return out


def split_group(group: Group) -> tuple[Group, Group]:
    """A group halved in sweep order (a group whose memory does not fit one device)."""
    half = (len(group.names) + 1) // 2
    return (
        Group(group.names[:half], group.reason, group.members[:half]),
        Group(group.names[half:], group.reason, group.members[half:]),
    )
