"""Why adapters below a frozen output layer cannot learn the demo task on the random tiny Llama.

The logits are `(g * n) @ W.T`, with `n` the final RMSNorm's normalised hidden state (norm
sqrt(h)), `g` its weight and `W` the output layer. Adapters on the decoder layers change only
`n`, so with `g` and `W` frozen every logit is at most sqrt(h) * max|g| * max_v |W_v|. This
prints that bound and the best parity reward any `n` can reach (the probability of the right
parity, maximised over the sphere by Adam; `parity_repeat`'s reward is that probability per
token), for the demo's random base at each seed and for trained HF directories (e.g. a
full-parameter demo run exported with `rl3d export RUN --dst DIR`):

    python benchmarks/lora_logit_bound.py --seeds 1 2 3 [--hf DIR ...]
"""

from __future__ import annotations

import argparse
import datetime
import math
from pathlib import Path

import torch
import torch.distributed as dist

RECIPE = Path(__file__).resolve().parents[1] / "recipes/quickstart_cpu_lora_grpo.yaml"


def parity_ceiling(gain: torch.Tensor, weight: torch.Tensor, *, steps: int = 2000) -> float:
    """max over normalised states n of P(token of the wanted parity), the worse of even and odd."""
    d, vocab = weight.shape[1], weight.shape[0]
    even = torch.arange(vocab) % 2 == 0
    best = []
    for wanted in (even, ~even):
        z = torch.randn(d, generator=torch.Generator().manual_seed(0)).requires_grad_()
        opt = torch.optim.Adam([z], lr=0.05)
        for _ in range(steps):
            n = z / z.norm() * math.sqrt(d)  # RMSNorm's output has norm sqrt(h)
            loss = -torch.logsumexp(torch.log_softmax((gain * n) @ weight.T, -1)[wanted], 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        best.append(math.exp(-loss.item()))
    return min(best)


def row(name: str, gain: torch.Tensor, weight: torch.Tensor) -> str:
    gain, weight = gain.detach().float(), weight.detach().float()
    bound = math.sqrt(weight.shape[1]) * gain.abs().max().item() * weight.norm(dim=1).max().item()
    return (
        f"| {name} | {gain.abs().max():.2f} | {weight.norm(dim=1).max():.3f} | {bound:.2f} | "
        f"{parity_ceiling(gain, weight):.3f} |"
    )


def random_bases(seeds: list[int]) -> list[str]:
    """The demo's LoRA actor as a run builds it (one rank here), one per seed."""
    from rl3d.config import load_config
    from rl3d.engine import MegatronEngine
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.utils.net import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=1234)
    cfg = load_config(RECIPE, ["actor.parallel.tp=1", "launch.nproc_per_node=1"]).config
    spec, out = spec_of(cfg.model), []
    for seed in seeds:
        role = MegatronEngine.from_config(
            spec, groups, role="actor", model=cfg.model, seed=seed, batching=cfg.actor,
            optim=cfg.actor.optim, lora=cfg.actor.lora,
        )  # fmt: skip
        model = role.unwrapped()
        weight = model.output_layer.weight[: spec.vocab_size]
        out.append(row(f"random base, seed {seed}", model.decoder.final_layernorm.weight, weight))
    return out


def trained(hf_dir: str) -> str:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return row(hf_dir, state["model.norm.weight"], state["lm_head.weight"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--hf", nargs="*", default=[], help="trained HF directories")
    args = parser.parse_args()
    lines = [
        "| weights | max abs g | max row norm of W | logit bound | best parity reward |",
        "|---|---|---|---|---|",
        *random_bases(args.seeds),
        *(trained(d) for d in args.hf),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
