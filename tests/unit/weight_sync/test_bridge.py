"""The weight-sync bridge waits `rollout.async.timeout_s` on NCCL too (torch's default is 10
minutes) and connects its whole communicator at set-up (a batched phase runs on it, and a rank
with nothing to send never joins a batch), and `reshard/seconds` stops only once the device
finished the transfer (NCCL's `wait()` returns before). NCCL needs CUDA: its process-group class
is recorded by a stand-in with torch's Options default; the gloo path runs for real."""

import datetime
import time
import types

import torch
import torch.distributed as dist

import rl3d.weight_sync.transfer as transfer
from rl3d.weight_sync import WeightBridge, send_weights


class RecordingNCCL:
    made: list = []
    connected: list = []

    class Options:
        def __init__(self):
            self._timeout = datetime.timedelta(minutes=10)  # torch's default for NCCL

    def __init__(self, store, rank, size, options):
        RecordingNCCL.made.append((rank, size, options))

    def eager_connect_single_device(self, device):
        RecordingNCCL.connected.append(device)


def test_the_nccl_bridge_waits_the_recipes_timeout(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingNCCL, raising=False)
    WeightBridge(dist.HashStore(), rank=1, num_train=2, num_rollout=2, device="cuda:0", timeout_s=1234.0)
    ((rank, size, options),) = RecordingNCCL.made
    assert (rank, size) == (1, 4) and options._timeout == datetime.timedelta(seconds=1234.0)
    assert [d.type for d in RecordingNCCL.connected] == ["cuda"]


def test_sync_seconds_include_the_device_finishing(monkeypatch):
    synced = []

    def slow_device(device):  # a device still copying when every work's wait() has returned
        time.sleep(0.2)
        synced.append(device)

    monkeypatch.setattr(transfer, "synchronize", slow_device)
    bridge = WeightBridge(dist.HashStore(), rank=0, num_train=1, num_rollout=0, device="cpu", timeout_s=5)
    nothing = types.SimpleNamespace(plan=types.SimpleNamespace(phases=[]), params=(), train=None)
    stats = send_weights(bridge, nothing, {}, pool_rank=0)
    assert synced == [torch.device("cpu")] and stats.seconds >= 0.2
