"""The `teacher` role of on-policy distillation: per-token log-probs of the student's samples
under one or more frozen teachers (`algorithm.distill`, `rl3d.algos.distill`).

Each teacher is an HF directory with the student's vocabulary; its shapes come from its own
config.json, so a teacher may be larger than the student. Teachers run colocated on the actor's
ranks, in the actor's layout, with the reference's micro-batching. With `teachers_by_source`
every teacher scores the whole batch and each row keeps its own teacher's log-probs: simple,
and as many forwards as teachers.
"""

from __future__ import annotations

import dataclasses

import torch

from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.hub import resolve_model_path
from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
from rl3d.models.spec import ModelSpec, spec_in_dir
from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register
from rl3d.workers.context import RoleContext
from rl3d.workers.megatron_role import MegatronRole
from rl3d.workers.roles import _megatron_info, _reference_batching


class TeacherWorker:
    def __init__(self, ctx: RoleContext):
        cfg, groups = ctx.cfg, ctx.groups
        self.cfg, self.groups = cfg, groups
        self.distill = distill = cfg.algorithm.distill
        self.teachers: dict[str, tuple[ModelSpec, MegatronRole]] = {}
        for path in distill.paths():
            spec = spec_in_dir(resolve_model_path(path))
            if spec.vocab_size != ctx.spec.vocab_size:
                raise ValueError(
                    f"algorithm.distill: teacher {path} has vocab_size {spec.vocab_size}, "
                    f"the student {ctx.spec.vocab_size}: a teacher must share the student's vocabulary"
                )
            role = MegatronRole.from_config(
                spec,
                groups,
                role="reference",  # frozen, forward only
                model=cfg.model,
                seed=cfg.trainer.seed,
                # the reference's micro-batching; offload around generation is the reference's own
                batching=dataclasses.replace(_reference_batching(cfg), offload=[]),
                total_steps=cfg.trainer.total_steps,
                hf_path=resolve_model_path(path),
            )
            self.teachers[path] = (spec, role)

    def dispatch_info(self) -> DispatchInfo:
        _, first = next(iter(self.teachers.values()))
        mini = self.cfg.actor.mini_batch_size if first.packing else 0
        return _megatron_info(self.groups, mini_batch_size=mini)

    def _logprobs(self, spec: ModelSpec, role: MegatronRole, batch: DataBatch) -> torch.Tensor | None:
        groups: MegatronGroups = self.groups

        def extract(output, micro):
            logits = role.response_slice(output, micro)
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
            )
            return torch.zeros(()), {"teacher_logp": logp.detach()}

        outs = role.run_forward(batch, self.cfg.actor.micro_batch_size, extract)
        return None if outs is None else torch.cat([o["teacher_logp"] for o in outs])

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_teacher_log_prob(self, batch: DataBatch) -> DataBatch | None:
        sources = batch["data_source"] if "data_source" in batch else [None] * len(batch)
        chosen = [self.distill.teacher_for(s) for s in sources]
        out = None
        for path, (spec, role) in self.teachers.items():
            logp = self._logprobs(spec, role, batch)
            if logp is None:
                return None
            rows = torch.tensor([c == path for c in chosen], device=logp.device)
            out = logp if out is None else torch.where(rows[:, None], logp, out)
        return DataBatch({"teacher_logp": out})
