"""A learned reward (or cost) model: a megatron-core GPTModel whose output layer is the scalar
value head (`rl3d.models.builder.ValueHead`), read at each sequence's last real token.

The same network is trained by the reward-model job (`rl3d.controller.rm_train`, Bradley-Terry
loss) and served in the RL loop by `RewardModelWorker` (`reward.model`, `reward.cost_model`),
on any TP/PP/DP layout: its weights are an rl3d Megatron weight directory (any layout loads it,
`rl3d.models.weights`) plus the value head in `value_head.safetensors`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl3d.config import ModelConfig
from rl3d.engine import last_token_outputs
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.spec import ModelSpec
from rl3d.single_controller.batch import PAD_VALUES, DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register

logger = logging.getLogger(__name__)

HEAD_FILE = "value_head.safetensors"
RM_META = "reward_model.json"  # {"objective": "reward" | "cost", ...}
LAST = "last_index"  # batch key: the position of each sequence's last real token
WHOLE_BATCH = 1 << 62  # DispatchInfo.token_balance: one chunk, capped at the batch's length


# -- the math ------------------------------------------------------------------------------------


def bradley_terry_loss(chosen_B: torch.Tensor, rejected_B: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs."""
    return -F.logsigmoid(chosen_B - rejected_B).mean()


def pair_metrics(chosen_B: torch.Tensor, rejected_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """Accuracy (the chosen response scores strictly higher; a tie counts as wrong) and margin."""
    diff = (chosen_B - rejected_B).detach().float()
    return {"accuracy": (diff > 0).float().mean(), "margin": diff.mean()}


def safety_sign_loss(cost_B: torch.Tensor, unsafe_sign_B: torch.Tensor) -> torch.Tensor:
    """Safe-RLHF's cost-model term: -log sigmoid(s * c), s = +1 unsafe, -1 safe, 0 unlabelled
    (no term), so that c > 0 reads "unsafe"."""
    labelled = unsafe_sign_B != 0
    if not labelled.any():
        return cost_B.sum() * 0.0
    return -F.logsigmoid(unsafe_sign_B[labelled] * cost_B[labelled]).mean()


def last_token_scores(output_BT1: torch.Tensor, micro: DataBatch) -> torch.Tensor:
    """[B]: the head's output at each sequence's last real token (`micro[LAST]` in the padded
    layout; packed or not)."""
    return last_token_outputs(output_BT1, micro, micro[LAST])[:, 0].float()


def sequence_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_token_id: int,
    width: tuple[int, int] | None = None,
) -> DataBatch:
    """Sequences as rl3d lays them out ([left-padded prompt | right-padded response]) with the
    position of each one's last real token. `width` = (P, R) fixes the padded widths."""
    P, R = width or (max(len(p) for p in prompts), max(max(len(r) for r in responses), 1))
    B = len(prompts)
    ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(p) : P + len(r)] = 1
    last = torch.tensor([P + len(r) - 1 for r in responses])
    return DataBatch(
        {"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, P:].clone(), LAST: last},
        info={PAD_VALUES: {"input_ids": pad_token_id}},
    )


# -- weights -------------------------------------------------------------------------------------


def save_reward_model(role, dst: Path, *, meta: dict) -> None:
    """The model of `role` (a MegatronEngine of role "critic") as a Megatron weight directory
    without an LM head, plus its value head and `meta` (collective over the role's world)."""
    from safetensors.torch import save_file

    from rl3d.models.convert import HF_EXTRA, McoreMeta, shard_dir_name
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.params import OUTPUT_LAYER, local_param, model_tensors, stage_param_names

    groups, spec, model = role.groups, role.spec, role.unwrapped()
    layout = groups.layout
    params = model_tensors(model)
    names = stage_param_names(spec, layout.p, groups.pp_rank, role="critic")
    if groups.dp_rank == 0 and groups.cp_rank == 0:  # one writer per shard
        tensors = {
            local: local_param(params, local).detach().to("cpu").contiguous()
            for name, local in names.items()
            if name != OUTPUT_LAYER
        }
        out = dst / shard_dir_name(groups.tp_rank, groups.pp_rank)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if groups.holds_outputs:
            head = model.output_layer.weight.detach().to("cpu").contiguous()
            save_file({"weight": head}, str(dst / HEAD_FILE), metadata={"format": "pt"})
    if groups.rank == 0:
        hf_config = hf_config_from_spec(spec).to_dict()
        McoreMeta(layout.t, layout.p, model.vocab_size, hf_config["model_type"], spec, hf_config).write(dst)
        (dst / HF_EXTRA).mkdir(exist_ok=True)
        (dst / HF_EXTRA / "config.json").write_text(json.dumps(hf_config, indent=2))
        (dst / RM_META).write_text(json.dumps(meta, indent=2, sort_keys=True))
    dist.barrier()


def reward_model_spec(weights_dir: Path) -> ModelSpec:
    from rl3d.models.convert import McoreMeta

    return McoreMeta.read(weights_dir).spec


def load_reward_model(
    spec: ModelSpec,
    groups: MegatronGroups,
    weights_dir: Path,
    *,
    model: ModelConfig,
    seed: int,
    batching=None,
    key: str = "reward.model",
):
    """A forward-only MegatronEngine holding the reward model of `weights_dir`, in this layout
    (`model.dtype`; `batching`: the reward-model section's packing, None: padded; `key`: that
    section, named in errors)."""
    from safetensors.torch import load_file

    from rl3d.engine import MegatronEngine

    role = MegatronEngine.from_config(
        spec,
        groups,
        role="critic",
        model=model,
        seed=seed,
        batching=batching,
        hf_path=str(weights_dir),
        key=key,
    )
    if groups.is_last_stage:
        head = load_file(str(weights_dir / HEAD_FILE))["weight"]
        with torch.no_grad():
            role.unwrapped().output_layer.weight.copy_(head)
    role.unwrapped().requires_grad_(False)
    return role


# -- the RL-loop worker --------------------------------------------------------------------------


class RewardModelWorker:
    """Scores each rollout's full responses with a learned model (`reward.model`, `kind`
    "reward"; `reward.cost_model`, kind "cost") and folds the score into the batch's `score`
    (`cost`): rule_weight * the rule's + weight * the model's. The rule's own value stays in the
    batch as `rule_score` (`rule_cost`) and in the metrics as `reward/rule_mean` (`cost/rule_mean`),
    so a run is judged by a rule its model never saw directly."""

    def __init__(self, ctx, *, kind: str = "reward"):
        from rl3d.config.reward_model import resolve_weights_dir

        assert kind in ("reward", "cost"), kind
        cfg = ctx.cfg
        self.kind, self.groups, self.pad_token_id = kind, ctx.groups, ctx.pad_token_id
        self.section = cfg.reward.model if kind == "reward" else cfg.reward.cost_model
        weights = resolve_weights_dir(self.section.path)
        spec = reward_model_spec(weights)
        self.role = load_reward_model(
            spec,
            ctx.groups,
            weights,
            model=cfg.model,
            seed=cfg.trainer.seed,
            batching=self.section,
            key="reward.model" if kind == "reward" else "reward.cost_model",
        )
        logger.info("%s model from %s (%s)", kind, weights, spec.name)

    def dispatch_info(self) -> DispatchInfo:
        g = self.groups
        return DispatchInfo(
            dp_rank=g.dp_rank,
            dp_size=g.layout.d,
            is_collector=g.holds_outputs,
            # packed: the whole batch's tokens balanced over the DP ranks (no mini-batches here)
            token_balance=WHOLE_BATCH if self.section.packing else 0,
        )

    def scores(self, batch: DataBatch) -> torch.Tensor | None:
        """[B] model outputs for the batch's (prompt, response) sequences (None off the last stage)."""
        resp_mask = batch["response_mask"]
        P = batch["input_ids"].shape[1] - resp_mask.shape[1]
        seqs = DataBatch(
            {
                "input_ids": batch["input_ids"],
                "attention_mask": batch["attention_mask"],
                "response_mask": resp_mask,
                LAST: P + resp_mask.sum(-1) - 1,
            }
        )
        n = len(batch)  # micro-batches must split this rank's share evenly: the largest that does
        micro = max(d for d in range(1, min(self.section.micro_batch_size, n) + 1) if n % d == 0)
        outs = self.role.run_forward(
            seqs,
            micro,
            lambda o, m: (torch.zeros(()), {"s": last_token_scores(o, m)}),
        )
        return None if outs is None else torch.cat([o["s"] for o in outs]).cpu()

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_score(self, batch: DataBatch) -> tuple[DataBatch, dict[str, float]] | None:
        if not len(batch):
            return None
        model = self.scores(batch)
        if model is None:
            return None
        key, rule_key, prefix = (
            ("score", "rule_score", "reward") if self.kind == "reward" else ("cost", "rule_cost", "cost")
        )
        rule = batch[key].float() if key in batch else torch.zeros(len(batch))
        combined = self.section.rule_weight * rule + self.section.weight * model
        metrics = {f"{prefix}/rule_mean": float(rule.mean()), f"{prefix}/model_mean": float(model.mean())}
        out = DataBatch({key: combined, rule_key: rule, f"{prefix}_model": model})
        return out, metrics


# -- HF export -----------------------------------------------------------------------------------

_SEQ_CLS = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification"}


def export_reward_model_hf(weights_dir: str | Path, dst: str | Path) -> Path:
    """A reward-model weight directory as an HF `*ForSequenceClassification` directory with one
    label (the value head as `score.weight`), what TRL and OpenRLHF load as a reward model; HF
    reads the score at the last non-pad token, as rl3d does. One process, written atomically."""
    from safetensors.torch import load_file, save_file

    from rl3d.models.convert import HF_EXTRA, McoreReader, atomic_output, copy_extras
    from rl3d.models.hf_mapping import tensor_maps
    from rl3d.models.params import OUTPUT_LAYER

    weights_dir, dst = Path(weights_dir), Path(dst)
    with McoreReader(weights_dir) as reader, atomic_output(dst) as out:
        meta = reader.meta
        if meta.model_type not in _SEQ_CLS:
            raise ValueError(f"{weights_dir}: no HF sequence-classification class for {meta.model_type!r}")
        tensors = {}
        for tmap in tensor_maps(meta.spec, meta.padded_vocab):
            if tmap.mcore == OUTPUT_LAYER:  # a reward model has no LM head
                continue
            for name, tensor in zip(tmap.hf, tmap.to_hf(reader.full(tmap.mcore)), strict=True):
                tensors[name] = tensor.contiguous()
        tensors["score.weight"] = load_file(str(weights_dir / HEAD_FILE))["weight"].contiguous()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if (weights_dir / HF_EXTRA).is_dir():
            copy_extras(weights_dir / HF_EXTRA, out)  # tokenizer files, when the model had them
        config = dict(meta.hf_config)
        config |= {"architectures": [_SEQ_CLS[meta.model_type]], "num_labels": 1}
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    logger.info("exported reward model %s as HF directory %s", weights_dir, dst)
    return dst
