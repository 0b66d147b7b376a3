"""The `teacher` role of on-policy distillation: per-token log-probs of the student's samples
under one or more frozen teachers (`algorithm.distill`, `rl3d.algos.distill`).

Each teacher shares the student's vocabulary: an HF directory (shapes from its config.json, so
a teacher may be larger than the student), or an rl3d run directory or one of its
`checkpoints/step_N` (the actor's dist checkpoint, read in this role's layout whatever layout
saved it; shapes from the run's model section). Teachers run colocated on the actor's ranks in
the actor's layout, or in their own pool in `algorithm.distill.parallel`, with the reference's
micro-batching (padded or packed, as the actor). With `teachers_by_source`
each teacher runs its forward on its own rows only (rows of a source without its own teacher
go to `teacher`), so a step costs one forward per row whatever the number of teachers.
"""

from __future__ import annotations

import dataclasses

import torch

from rl3d.config.run_dir import teacher_weights
from rl3d.engine import MegatronEngine, forward_micro_batch
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
from rl3d.models.spec import ModelSpec
from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register
from rl3d.workers.context import RoleContext
from rl3d.workers.roles import _megatron_info


class TeacherWorker:
    def __init__(self, ctx: RoleContext):
        cfg, groups = ctx.cfg, ctx.groups
        self.cfg, self.groups = cfg, groups
        self.distill = distill = cfg.algorithm.distill
        self.teachers: dict[str, tuple[ModelSpec, MegatronEngine]] = {}
        layout, key = groups.layout, "actor.parallel" if distill.colocate else "algorithm.distill.parallel"
        for path in distill.paths():
            spec, weights = teacher_weights(path)
            if spec.vocab_size != ctx.spec.vocab_size:
                raise ValueError(
                    f"algorithm.distill: teacher {path} has vocab_size {spec.vocab_size}, "
                    f"the student {ctx.spec.vocab_size}: a teacher must share the student's vocabulary"
                )
            if spec.num_query_groups % layout.t or spec.num_layers % layout.p:
                raise ValueError(
                    f"{key}: tp={layout.t} must divide teacher {path}'s {spec.num_query_groups} KV heads "
                    f"and pp={layout.p} its {spec.num_layers} layers"
                )
            role = MegatronEngine.from_config(
                spec,
                groups,
                role="reference",  # frozen, forward only
                model=cfg.model,
                seed=cfg.trainer.seed,
                # the reference's micro-batching; offload around generation is the reference's own
                batching=dataclasses.replace(cfg.reference.batching_of(cfg.actor), offload=[]),
                total_steps=cfg.trainer.total_steps,
                hf_path=weights,
            )
            self.teachers[path] = (spec, role)
        self.rows_scored = dict.fromkeys(self.teachers, 0)  # rows each teacher has scored

    def dispatch_info(self) -> DispatchInfo:
        _, first = next(iter(self.teachers.values()))
        mini = self.cfg.actor.mini_batch_size if first.packing else 0
        return _megatron_info(self.groups, mini_batch_size=mini)

    def _logprobs(self, spec: ModelSpec, role: MegatronEngine, batch: DataBatch) -> torch.Tensor | None:
        groups: MegatronGroups = self.groups

        def extract(output, micro):
            logits = role.response_slice(output, micro)
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
            )
            return torch.zeros(()), {"teacher_logp": logp.detach()}

        outs = role.run_forward(batch, forward_micro_batch(self.cfg.actor, len(batch)), extract)
        return None if outs is None else torch.cat([o["teacher_logp"] for o in outs])

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_teacher_log_prob(self, batch: DataBatch) -> DataBatch | None:
        """Each teacher scores only the rows its `data_source` maps it to (`teacher_for`); every
        stage runs every teacher's forward, so pipeline stages stay in step."""
        sources = batch["data_source"] if "data_source" in batch else [None] * len(batch)
        chosen = [self.distill.teacher_for(s) for s in sources]
        out = None
        for path, (spec, role) in self.teachers.items():
            rows = [i for i, c in enumerate(chosen) if c == path]
            if not rows:
                continue
            logp = self._logprobs(spec, role, batch.select(rows))
            self.rows_scored[path] += len(rows)
            if logp is None:  # not the last pipeline stage
                continue
            if out is None:
                out = logp.new_zeros((len(batch), logp.shape[1]))
            out[torch.tensor(rows, device=logp.device)] = logp
        if out is None and self.groups.is_last_stage:  # no rows on this rank
            out = torch.zeros(len(batch), batch["responses"].shape[1])
        return None if out is None else DataBatch({"teacher_logp": out})
