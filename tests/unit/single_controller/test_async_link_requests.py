"""The async link's generation requests and step positions over a real TCPStore: a request and
each engine's answer round-trip, a missing answer ends the wait naming the request and the
rollout rank, a reported failure ends it with that line, and dropped keys are gone."""

import datetime

import pytest
import torch.distributed as dist

from rl3d.single_controller.async_link import AsyncLink, AsyncLinkError
from rl3d.single_controller.batch import DataBatch


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))


def test_request_reply_and_position_round_trip(store):
    trainer = AsyncLink(store, timeout_s=5, who="training rank 0")
    pool = AsyncLink(store, timeout_s=5, who="rollout pool rank 0")
    prompts = DataBatch(meta={"prompt_ids": [[1, 2], [3]], "uid": [7, 8]})
    assert not pool.has_request(0)
    trainer.put_request(0, {"prompts": prompts, "seed": 1 << 30, "greedy": True, "version": 3})
    assert pool.has_request(0) and not pool.has_request(1)
    got = pool.get_request(0)
    assert got["prompts"]["uid"] == [7, 8]
    assert (got["seed"], got["greedy"], got["version"]) == (1 << 30, True, 3)
    for dp in (1, 0):  # engines answer in any order; the trainer reads them in engine order
        pool.put_reply(0, dp, ("slot", dp))
    assert trainer.get_replies(0, 2, [2, 3]) == [("slot", 0), ("slot", 1)]
    trainer.drop_request(0, 2)
    assert not pool.has_request(0)

    trainer.put_position(5, {"epoch": 0, "offset": 24})
    assert pool.has_position(5) and pool.get_position(5) == {"epoch": 0, "offset": 24}
    trainer.drop_position(5)
    assert not pool.has_position(5)
    trainer.drop_position(6)  # never posted: nothing to drop, no error


def test_a_missing_answer_names_the_request_and_rank(store):
    trainer = AsyncLink(store, timeout_s=0.2, who="training rank 0")
    with pytest.raises(AsyncLinkError, match=r"training rank 0: generation request 4 \(world rank 9\)"):
        trainer.get_replies(4, 1, [9])
    AsyncLink(store, timeout_s=5, who="rollout pool rank 0").fail("rollout pool rank 0 failed: boom")
    with pytest.raises(AsyncLinkError, match="rollout pool rank 0 failed: boom"):
        AsyncLink(store, timeout_s=5, who="training rank 0").get_replies(4, 1, [9])
