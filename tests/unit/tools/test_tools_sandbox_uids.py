"""The uid leases of concurrent sandbox runs: distinct while held, the lone run's uid first, and
a wait (never a shared uid) when the pool is spent."""

import threading
import time

import pytest

from rl3d.tools import _sandbox_uids
from rl3d.tools._sandbox_uids import lease


@pytest.fixture(autouse=True)
def private_lock_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(_sandbox_uids, "LOCK_DIRS", (str(tmp_path / "leases"),))


def test_held_leases_are_distinct_and_a_lone_run_gets_the_first():
    with lease(1000, 3) as a, lease(1000, 3) as b, lease(1000, 3) as c:
        assert sorted([a, b, c]) == [998, 999, 1000]
    with lease(1000, 3) as again:
        assert again == 1000
    with lease(None, 3) as none:
        assert none is None  # no drop (a user namespace, or user: null): nothing to lease


def test_a_spent_pool_waits_for_a_release():
    taken = []

    def take():
        with lease(1000, 1) as uid:
            taken.append(uid)

    with lease(1000, 1) as first:
        waiter = threading.Thread(target=take)
        waiter.start()
        time.sleep(0.3)
        assert taken == []  # still waiting: the only uid is held
    waiter.join(5)
    assert first == 1000 and taken == [1000]
