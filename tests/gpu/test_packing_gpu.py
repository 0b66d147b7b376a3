"""Packed vs padded on one GPU (a world of 1 on NCCL): log-probs, values and one optimizer step
agree as they do on CPU. The packed modes run Transformer Engine's layer spec (THD, cu_seqlens)
and the padded mode megatron's local spec, from the same weights; without TE packing is refused."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the packed path on a GPU"),
]
CPU_TEST = Path(__file__).resolve().parents[1] / "distributed" / "models" / "test_packing_dist.py"
TE_TOL = 1e-5  # TE's unfused fp32 attention against the local spec's: other kernels, other sums


def _packed_vs_padded(tmp_path) -> dict[str, float]:
    pytest.importorskip("transformers", reason="the tiny HF model the CPU test starts from")
    import torch.distributed as dist

    from rl3d.testing.spawn import free_port
    from rl3d.testing.tiny_hf import save_tiny_hf_model
    from rl3d.utils.device import init_process_group

    spec = importlib.util.spec_from_file_location("packing_cases", CPU_TEST)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)  # the CPU test's worker and checks, run here on CUDA
    hf_dir = tmp_path / "tiny-qwen2"
    save_tiny_hf_model("tiny-qwen2", hf_dir, seed=3)
    init_process_group(
        "cuda", timeout_s=300, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        result = cases.worker(0, 1, (1, 1, 1), str(hf_dir))
    finally:
        dist.destroy_process_group()
    assert result["padded"]["logp"].device.type == "cuda"
    diffs = cases._max_diffs([result])
    print({k: f"{v:.1e}" for k, v in diffs.items()})  # noqa: T201
    assert len(diffs) == 6, diffs
    return diffs


def test_packing_on_a_gpu_without_transformer_engine_is_refused(tmp_path):
    """Without TE a packed row would run megatron's local attention on an [N, N] mask: the
    role build refuses it, naming the key (with TE the next test runs the packed modes)."""
    if importlib.util.find_spec("transformer_engine"):
        pytest.skip("Transformer Engine is installed on this GPU machine")
    with pytest.raises(ValueError, match=r"actor\.packing: true on a CUDA device needs Transformer Engine"):
        _packed_vs_padded(tmp_path)


def test_packed_under_te_spec_equals_padded_local_spec(tmp_path):
    pytest.importorskip(
        "transformer_engine", reason="Transformer Engine is not installed on this GPU machine"
    )
    from rl3d.models.builder import use_transformer_engine

    cuda = torch.device("cuda")
    assert use_transformer_engine(cuda, packed=True)  # packed roles: TE's spec, THD boundaries
    assert not use_transformer_engine(cuda)  # left-padded batches stay on the local spec
    diffs = _packed_vs_padded(tmp_path)
    assert max(diffs.values()) <= TE_TOL, diffs
