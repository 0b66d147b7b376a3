"""Which ranks share a node, and the bytes each link carries.

A `NodeMap` is the caller's grouping of ranks into nodes: any disjoint sets, not only runs
of consecutive ranks (a launcher may place ranks round-robin, and a network-namespace
fixture may put any ranks behind one shaped link). `NodeMap.contiguous(world, k)` is the
usual assignment: ranks 0..k-1 on node 0, k..2k-1 on node 1, and so on.

`link_bytes` splits logical point-to-point traffic (bytes from a sender to a receiver,
whatever algorithm a backend runs underneath) over the links it crosses: the intra-node
fabric of a node, or a node's network link inbound and outbound (full duplex, so the busier
direction sets the time).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeMap:
    nodes: tuple[tuple[int, ...], ...]
    _node_of: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for k, members in enumerate(self.nodes):
            if not members:
                raise ValueError(f"node {k} has no ranks")
            for r in members:
                if r in self._node_of:
                    raise ValueError(f"rank {r} is on node {self._node_of[r]} and node {k}")
                self._node_of[r] = k

    @classmethod
    def contiguous(cls, world: int, gpus_per_node: int) -> NodeMap:
        """Ranks 0..k-1 on node 0, k..2k-1 on node 1, ...; the last node may be partly filled."""
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        return cls(
            tuple(tuple(range(s, min(s + gpus_per_node, world))) for s in range(0, world, gpus_per_node))
        )

    @classmethod
    def of(cls, nodes) -> NodeMap:
        return cls(tuple(tuple(int(r) for r in n) for n in nodes))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        if rank not in self._node_of:
            raise ValueError(f"rank {rank} is on no node of {self.nodes}")
        return self._node_of[rank]

    def covers(self, ranks) -> bool:
        return all(r in self._node_of for r in ranks)

    def to_json(self) -> list[list[int]]:
        return [list(n) for n in self.nodes]


@dataclass(frozen=True)
class LinkBytes:
    """Bytes per link: `intra[n]` inside node n, `inter_in[n]`/`inter_out[n]` through its network link."""

    intra: dict[int, int]
    inter_in: dict[int, int]
    inter_out: dict[int, int]

    @property
    def node_bytes_max(self) -> int:
        """The busiest node link, either direction: what bounds a transition across nodes."""
        return max([*self.inter_in.values(), *self.inter_out.values()], default=0)

    @property
    def inter_total(self) -> int:
        return sum(self.inter_in.values())

    def to_json(self) -> dict:
        return {
            "intra": {str(k): v for k, v in sorted(self.intra.items())},
            "inter_in": {str(k): v for k, v in sorted(self.inter_in.items())},
            "inter_out": {str(k): v for k, v in sorted(self.inter_out.items())},
            "inter_total": self.inter_total,
            "node_bytes_max": self.node_bytes_max,
        }


def link_bytes(pairs: dict[tuple[int, int], int], nodes: NodeMap) -> LinkBytes:
    """Split {(src, dst): bytes} over the links they cross (every node appears, with 0 if idle)."""
    intra: dict[int, int] = defaultdict(int)
    inter_in: dict[int, int] = defaultdict(int)
    inter_out: dict[int, int] = defaultdict(int)
    for k in range(nodes.num_nodes):
        intra[k] = inter_in[k] = inter_out[k] = 0
    for (src, dst), nbytes in pairs.items():
        a, b = nodes.node_of(src), nodes.node_of(dst)
        if a == b:
            intra[a] += nbytes
        else:
            inter_out[a] += nbytes
            inter_in[b] += nbytes
    return LinkBytes(dict(intra), dict(inter_in), dict(inter_out))
