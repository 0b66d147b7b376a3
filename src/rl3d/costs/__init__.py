"""Cost models shared by the benchmark (`rl3d.bench`) and the planner (`rl3d.planning`): a GPU
cluster's links (`cluster`), NCCL's per-call latency (`nccl`), each system's transition as the
calls it makes (`mechanisms`), the optimizer step through HBM (`optimizer`) and the shape of a
micro-batch on one rank (`micro_batch`). Pure Python over shapes and plans: no GPU, no tensors, no
torch.
"""
