"""Checks of the GPU path that span sections: offload around generation, the megatron fusions a
run asks for (`rl3d.config.megatron`) and what the SGLang engine cannot do yet. They run with the
other cross-section checks (`rl3d.config.checks`)."""

from __future__ import annotations

from rl3d.config.megatron import check_megatron
from rl3d.config.schema import RL3DConfig


def check_gpu_path(cfg: RL3DConfig, fail) -> None:
    _check_offload(cfg, fail)
    check_megatron(cfg, fail)
    ro = cfg.rollout
    if ro.engine == "sglang" and cfg.launch.backend == "ray" and ro.t_g > 1:
        # SGLang puts its TP rank i on GPU base_gpu_id + i * gpu_id_step; a Ray rank actor sees
        # only its own bundle's one GPU, so ranks 1.. would land on GPUs it cannot see
        raise fail(
            "rollout.t_g",
            f"t_g={ro.t_g} with rollout.engine=sglang needs launch.backend=spmd: a Ray rank actor "
            "holds one GPU, and SGLang's engine spans t_g of them (or set rollout.t_g: 1)",
        )


def _check_offload(cfg: RL3DConfig, fail) -> None:
    """Offload happens around the colocated engine's generation: a role must share the
    generating ranks, and the torch engine generates on the actor's own (resharded) tensors."""
    colocated = cfg.rollout.placement == "colocated"
    roles = (
        ("actor", cfg.actor.offload, colocated),
        ("critic", cfg.critic.offload, colocated and cfg.critic.colocate and cfg.critic_enabled),
        ("reference", cfg.reference.offload, colocated and cfg.reference.colocate and cfg.reference_enabled),
    )
    for name, offload, generating in roles:
        if offload and not generating:
            raise fail(
                f"{name}.offload",
                f"{offload}: offload happens around generation on the actor's ranks, and the "
                f"{name} is not there (a separate pool, its own pool, or disabled); drop it",
            )
    if "params" in cfg.actor.offload and cfg.rollout.engine == "torch":
        raise fail(
            "actor.offload",
            "'params' with rollout.engine=torch: that engine generates on the actor's resharded "
            "parameters (views of the training tensors); offload params only with rollout.engine=sglang",
        )
