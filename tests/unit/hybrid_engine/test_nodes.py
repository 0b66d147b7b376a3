"""NodeMap and the bytes per link, and the hierarchical plan's routing, from shapes alone."""

import pytest

import rl3d.bench  # noqa: F401  registers hybridflow_hier
from rl3d.hybrid_engine import plan_transition
from rl3d.hybrid_engine.nodes import NodeMap, link_bytes
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout


def test_contiguous_and_given_nodes():
    assert NodeMap.contiguous(6, 4).nodes == ((0, 1, 2, 3), (4, 5))
    nodes = NodeMap.of([[0, 3], [1, 2]])
    assert [nodes.node_of(r) for r in range(4)] == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="rank 1 is on node 0 and node 1"):
        NodeMap.of([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="rank 9 is on no node"):
        nodes.node_of(9)


def test_link_bytes_split_intra_and_each_direction():
    links = link_bytes({(0, 1): 5, (0, 2): 7, (3, 1): 11}, NodeMap.contiguous(4, 2))
    assert links.intra == {0: 5, 1: 0}
    assert links.inter_out == {0: 7, 1: 11} and links.inter_in == {0: 11, 1: 7}
    assert links.node_bytes_max == 11 and links.inter_total == 18


def test_nodes_must_cover_the_training_ranks():
    with pytest.raises(ValueError, match="leave out"):
        plan_transition(
            get_model_spec("tiny-llama"), ParallelLayout(2, 2, 1), 1, nodes=NodeMap.of([[0, 1], [2]])
        )


@pytest.mark.parametrize(
    "model, train, t_g, gpus_per_node",
    [("tiny-llama", (2, 2, 1), 1, 2), ("tiny-llama", (2, 2, 2), 2, 4), ("llama2-70b", (8, 8, 2), 4, 8)],
)
def test_hierarchical_plan_halves_the_node_link_and_keeps_each_ranks_bytes(model, train, t_g, gpus_per_node):
    layout = ParallelLayout(*train)
    nodes = NodeMap.contiguous(layout.world_size, gpus_per_node)
    plan = plan_transition(
        get_model_spec(model), layout, t_g, strategies=("hybridflow", "hybridflow_hier"), nodes=nodes
    )
    flat, hier = plan.strategies["hybridflow"], plan.strategies["hybridflow_hier"]
    # each rank receives the same pieces (same weights), some relayed by a node-mate
    assert [r.recv_bytes for r in hier.ranks] == [r.recv_bytes for r in flat.ranks]
    assert [r.peak_param_bytes for r in hier.ranks] == [r.peak_param_bytes for r in flat.ranks]
    a, b = plan.link_bytes("hybridflow", nodes), plan.link_bytes("hybridflow_hier", nodes)
    assert b.inter_total * 2 == pytest.approx(a.inter_total, rel=0.01)
    assert hier.links == b.to_json()
    # phase 2 only relays inside a node
    assert all(nodes.node_of(t.src) == nodes.node_of(t.dst) for t in hier.phases[-1])


def test_paper_layout_has_nothing_to_share_across_a_nodes_gpus():
    # 70B 8,8 -> 8,1: each GPU of a node needs a different TP shard of the other stages, so
    # only the replicated norms can be fetched once per node
    layout = ParallelLayout(8, 8, 1)
    nodes = NodeMap.contiguous(64, 8)
    plan = plan_transition(
        get_model_spec("llama2-70b"), layout, 8, strategies=("hybridflow", "hybridflow_hier")
    )
    a, b = plan.link_bytes("hybridflow", nodes), plan.link_bytes("hybridflow_hier", nodes)
    assert 0.999 < b.node_bytes_max / a.node_bytes_max <= 1.0
