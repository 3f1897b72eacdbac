"""Boundary plans: which owned rows each client sends to which peer, and the local owned + halo graph."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from retexo_fl.data.partition import CROSS_IN, CROSS_OUT, Partition, peer_order, peer_runs, sorted_unique


class PlanMismatchError(ValueError):
    """Two clients derived different boundary plans for the rows that pass between them."""


def ids_bytes(ids: np.ndarray) -> bytes:
    """An ordered id list as the bytes its digest or tag reads: little-endian int64."""
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def ids_digest(ids: np.ndarray) -> str:
    """A short digest of an ordered id list; equal on both sides iff both derived the same plan.

    Unkeyed: anyone who can guess the list can test the guess (a list of one or two ids, out of
    a known id space, is found by trying them all). What a client reports at setup is keyed when
    it has a sealed channel to the peer (:meth:`BoundaryPlan.digests`).

    Args:
        ids (np.ndarray): the global ids, in the order they travel.

    Shapes:
        - **input:** ``ids`` ``[k]``

    Returns:
        The first 32 hex digits of the SHA-256 of the ids as little-endian int64.
    """
    return hashlib.sha256(ids_bytes(ids)).hexdigest()[:32]


#: ``tag(src, dst, message)``: a tag both ends of the direction ``src`` to ``dst`` compute alike
#: and no one else can (:meth:`~retexo_fl.secure.envelope.Envelopes.plan_tag`), or ``None``.
PairTag = Callable[[int, int, bytes], "str | None"]


#: A set-up pass reads ids through a table of the whole id space where its records are at least
#: this fraction of the ids (:func:`dense_lookups`) ...
DENSE_RECORDS_PER_ID = 1 / 8
#: ... and marks a client's (peer, owned row) pairs in a table of every such pair where that
#: table holds at most this many entries a record (else it sorts the pairs).
MARKS_PER_RECORD = 16


def dense_lookups(part: Partition, records: int) -> bool:
    """Whether a set-up pass over ``records`` edges of ``part`` reads its ids through tables
    of the whole id space (one gather an id) rather than sorts and binary searches.

    A table costs a pass over every global id; where the records are at least an eighth of
    them, that is cheaper than sorting or searching the records' ids (whose queries miss the
    cache). At one node a client (a handful of edges in a large id space) it is not.
    """
    return records >= DENSE_RECORDS_PER_ID * part.num_global_nodes


@dataclass
class BoundaryPlan:
    """One client's side of every exchange, derived from its own cross edges only.

    Both sides order rows by global id, so no ids travel during an exchange. Build one with
    :meth:`from_partition`.

    Args:
        partition_id (int): the client this plan belongs to.
        send (dict[int, np.ndarray]): peer -> ``[k]`` local row indices (into the owned nodes) the
            peer needs, ordered by global id.
        send_ids (dict[int, np.ndarray]): peer -> the same rows as global ids (for digests only).
        recv (dict[int, np.ndarray]): peer -> ``[k]`` global ids of the peer's nodes this client
            aggregates, sorted.
        halo_ids (np.ndarray): ``[H]`` all received ids, peers in increasing order, each peer's
            block sorted; halo row ``i`` of a stage input is ``halo_ids[i]``.
        halo_offsets (dict[int, tuple[int, int]]): peer -> ``(start, stop)`` of its block in
            ``halo_ids``.
    """

    partition_id: int
    send: dict[int, np.ndarray]
    send_ids: dict[int, np.ndarray]
    recv: dict[int, np.ndarray]
    halo_ids: np.ndarray
    halo_offsets: dict[int, tuple[int, int]]

    @classmethod
    def from_partition(cls, part: Partition) -> BoundaryPlan:
        """The plan of ``part``'s client, read from its cross edges (``OUT`` rows sent, ``IN`` received).

        Args:
            part (Partition): the client's partition.
        """
        c = part.cross_edges
        send, send_ids, recv = {}, {}, {}
        if c.size and dense_lookups(part, c.shape[0]):
            return cls._from_marks(part, c)
        if c.size:
            order = peer_order(c[:, 2])
            own, remote, way = c[order, 0], c[order, 1], c[order, 3]
            for q, lo, hi in peer_runs(c[order, 2]):
                w = way[lo:hi]
                out_ids = sorted_unique(own[lo:hi][(w & CROSS_OUT) != 0], in_place=True)
                in_ids = sorted_unique(remote[lo:hi][(w & CROSS_IN) != 0], in_place=True)
                if out_ids.size:
                    send_ids[q] = out_ids
                    send[q] = np.searchsorted(part.node_ids, out_ids)
                if in_ids.size:
                    recv[q] = in_ids
        return cls._assembled(part.partition_id, send, send_ids, recv)

    @classmethod
    def _from_marks(cls, part: Partition, c: np.ndarray) -> BoundaryPlan:
        """:meth:`from_partition` by marking rows in dense tables instead of sorting ids: the same
        plan, for a client whose cross edges are many for the id space (:func:`dense_lookups`).
        On a 300,000-node graph in 8 random parts (650,000 cross edges a client) it takes a fifth
        of the sorts' time."""
        n, ids = part.num_nodes, part.node_ids
        out = c[(c[:, 3] & CROSS_OUT) != 0]
        inc = c[(c[:, 3] & CROSS_IN) != 0]
        send, send_ids, recv = {}, {}, {}
        if out.size:
            local = np.empty(part.num_global_nodes, dtype=np.int64)
            local[ids] = np.arange(n)
            peers = np.flatnonzero(np.bincount(out[:, 2]))
            slot = np.zeros(int(peers[-1]) + 1, dtype=np.int64)
            slot[peers] = np.arange(peers.size)
            # Each (peer, owned row) pair the peer needs as one key, peers in increasing order
            # and rows increasing within each (increasing global ids): marked in a table of
            # every pair when that is not much larger than the records, else sorted.
            keys = slot[out[:, 2]] * n + local[out[:, 0]]
            if peers.size * n <= MARKS_PER_RECORD * out.shape[0]:
                marks = np.zeros(peers.size * n, dtype=bool)
                marks[keys] = True
                keys = np.flatnonzero(marks)
            else:
                keys = sorted_unique(keys, in_place=True)
            bounds = np.searchsorted(keys, np.arange(peers.size + 1) * n).tolist()
            for i, q in enumerate(peers.tolist()):
                rows = keys[bounds[i] : bounds[i + 1]] - i * n
                send[q], send_ids[q] = rows, ids[rows]
        if inc.size:
            owner = np.full(part.num_global_nodes, -1, dtype=np.int64)
            owner[inc[:, 1]] = inc[:, 2]  # validated: one remote id has one owner
            remote = np.flatnonzero(owner >= 0)  # every received id, increasing
            owners = owner[remote]
            order = peer_order(owners)  # stable: each peer's ids stay increasing
            grouped = remote[order]
            for q, lo, hi in peer_runs(owners[order]):
                recv[q] = grouped[lo:hi]
        return cls._assembled(part.partition_id, send, send_ids, recv)

    @classmethod
    def _assembled(
        cls,
        pid: int,
        send: dict[int, np.ndarray],
        send_ids: dict[int, np.ndarray],
        recv: dict[int, np.ndarray],
    ) -> BoundaryPlan:
        """The plan of these lists, the halo in peer order."""
        offsets, start = {}, 0
        for q in sorted(recv):
            offsets[q] = (start, start + recv[q].size)
            start += recv[q].size
        halo = np.concatenate([recv[q] for q in sorted(recv)]) if recv else np.zeros(0, np.int64)
        return cls(pid, send, send_ids, recv, halo.astype(np.int64), offsets)

    @property
    def num_halo(self) -> int:
        """``H``: the number of halo rows this client receives per exchange."""
        return int(self.halo_ids.size)

    def digests(self, tag: PairTag | None = None) -> dict[str, dict[int, str]]:
        """Digests a client reports at setup: ``send`` and ``recv`` per peer.

        Args:
            tag (PairTag, optional): keys each digest to its pair (the send list to ``q`` under
                the direction to ``q``, the receive list under the direction from it), so that
                the server, who sees the digests, can compare two parties' but not test a guess
                of the ids behind one. A peer without a tag (no channel to it) gets an empty
                digest. (default: :obj:`None`: unkeyed :func:`ids_digest`)

        Returns:
            ``{"send": {peer: digest}, "recv": {peer: digest}}``.
        """
        if tag is None:
            return {
                "send": {q: ids_digest(v) for q, v in self.send_ids.items()},
                "recv": {q: ids_digest(v) for q, v in self.recv.items()},
            }
        me = self.partition_id
        return {
            "send": {q: tag(me, q, ids_bytes(v)) or "" for q, v in self.send_ids.items()},
            "recv": {q: tag(q, me, ids_bytes(v)) or "" for q, v in self.recv.items()},
        }

    def rows_for(self, embeddings: torch.Tensor) -> dict[int, torch.Tensor]:
        """Split owned-node ``embeddings`` into the row blocks each peer needs.

        Args:
            embeddings (torch.Tensor): one row per owned node.

        Shapes:
            - **input:** ``embeddings`` ``[n, d]``
            - **output:** ``{peer: [k_peer, d]}``
        """
        return {q: embeddings[torch.from_numpy(idx)] for q, idx in self.send.items()}

    def assemble_halo(self, incoming: dict[int, torch.Tensor], dim: int) -> torch.Tensor:
        """Stack received blocks into the halo matrix, checking shapes.

        Args:
            incoming (dict[int, torch.Tensor]): peer -> the block it sent.
            dim (int): the row width ``d``.

        Shapes:
            - **input:** ``incoming[peer]`` ``[k_peer, d]``
            - **output:** ``[H, d]``, rows in :attr:`halo_ids` order (``[0, d]`` with no halo)

        Raises:
            PlanMismatchError: if a peer this client receives from sent nothing, or a block of another
                shape than the plan's.
        """
        missing = sorted(set(self.recv) - set(incoming))
        if missing:
            raise PlanMismatchError(f"client {self.partition_id}: no rows received from client(s) {missing}")
        blocks = []
        for q in sorted(self.recv):
            block = incoming[q]
            want = (self.recv[q].size, dim)
            if tuple(block.shape) != want:
                raise PlanMismatchError(
                    f"client {self.partition_id}: client {q} sent rows of shape {tuple(block.shape)}, "
                    f"expected {want}"
                )
            blocks.append(block)
        return torch.cat(blocks) if blocks else torch.zeros(0, dim)


#: What a plan mismatch most often means in a deployment, said with it.
_NOT_ONE_CUT = (
    ": their partitions are not parts of one cut (each party's partition folder must be its part "
    "of the same `retexo-fl partition` output: one dataset, method, seed and number of parts)"
)


def check_plans(digests: dict[int, dict[str, dict[int, str]]]) -> None:
    """Check every pair's send and receive digests against each other.

    Only pairs of clients that both reported are checked: a client lost at setup reports no
    plan, and its peers' rows from it are missing (as ``on-missing-halo`` says).

    Args:
        digests (dict[int, dict[str, dict[int, str]]]): client -> :meth:`BoundaryPlan.digests`
            (keys may be str after transport).

    Raises:
        PlanMismatchError: naming both clients of the first pair that disagrees.
    """
    norm = {
        int(p): {k: {int(q): v for q, v in d.get(k, {}).items()} for k in ("send", "recv")}
        for p, d in digests.items()
    }
    for p, d in sorted(norm.items()):
        for q, digest in sorted(d["send"].items()):
            if q not in norm:
                continue
            theirs = norm[q]["recv"].get(p)
            if theirs != digest:
                raise PlanMismatchError(
                    f"boundary plan mismatch: client {p} would send rows to client {q} "
                    f"(digest {digest[:12]}) but client {q} expects "
                    f"{'nothing' if theirs is None else 'digest ' + theirs[:12]} from client {p}"
                    f"{_NOT_ONE_CUT}"
                )
        for q in d["recv"]:
            if q in norm and p not in norm[q]["send"]:
                raise PlanMismatchError(
                    f"boundary plan mismatch: client {p} expects rows from client {q}, "
                    f"which plans to send none{_NOT_ONE_CUT}"
                )


@dataclass
class LocalGraph:
    """A client's message-passing graph over owned rows ``[0, n)`` then halo rows ``[n, n + H)``.

    Every edge ends at an owned node, so owned outputs are exact and halo rows are constant inputs.
    Build one with :meth:`build`.

    Args:
        num_owned (int): ``n``, the owned nodes.
        num_halo (int): ``H``, the halo rows.
        edge_index (torch.Tensor): ``[2, E]`` local (src, dst) indices, dst < n, no self loops.
        in_degree (torch.Tensor): ``[n]`` global in-degree of each owned node (local plus cross
            in-edges), float.
    """

    num_owned: int
    num_halo: int
    edge_index: torch.Tensor
    in_degree: torch.Tensor

    @classmethod
    def build(cls, part: Partition, plan: BoundaryPlan) -> LocalGraph:
        """The local graph of ``part``: its local edges, then its cross in-edges from halo rows.

        Args:
            part (Partition): the client's partition.
            plan (BoundaryPlan): its boundary plan (fixes the halo rows' order).
        """
        n = part.num_nodes
        ids = part.node_ids
        c = part.cross_edges
        inc = c[(c[:, 3] & CROSS_IN) != 0] if c.size else np.zeros((0, 4), np.int64)
        if dense_lookups(part, part.edges.shape[1] + inc.shape[0]):
            # Many lookups for the id space: one table from global id to local row (owned rows,
            # then halo rows in halo_ids order) read by gather. On a 300,000-node graph in 8
            # random parts that is 12x faster than a binary search per endpoint, whose queries
            # (unsorted, 1.3 million a client) miss the cache; the rows are the same.
            local = np.empty(part.num_global_nodes, dtype=np.int64)
            local[ids] = np.arange(n)
            local[plan.halo_ids] = np.arange(n, n + plan.num_halo)
            src, dst = local[part.edges[0]], local[part.edges[1]]
            csrc, cdst = local[inc[:, 1]], local[inc[:, 0]]
        else:  # a few edges in a large id space (one node a client): no table of every id
            src, dst = np.searchsorted(ids, part.edges[0]), np.searchsorted(ids, part.edges[1])
            csrc = np.empty(len(inc), dtype=np.int64)
            for q, (start, _) in plan.halo_offsets.items():
                sel = inc[:, 2] == q
                csrc[sel] = n + start + np.searchsorted(plan.recv[q], inc[sel, 1])
            cdst = np.searchsorted(ids, inc[:, 0])
        if inc.size:
            src, dst = np.concatenate([src, csrc]), np.concatenate([dst, cdst])
        edge_index = torch.from_numpy(np.stack([src, dst]).astype(np.int64))
        deg = torch.bincount(edge_index[1], minlength=n).float()
        return cls(n, plan.num_halo, edge_index, deg)

    def gcn_weights(self, halo_degree: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Edges with owned self loops and symmetric GCN weights from *global* degrees.

        Args:
            halo_degree (torch.Tensor): global in-degrees of the halo nodes, sent once by their owners.

        Shapes:
            - **input:** ``halo_degree`` ``[H]``
            - **output:** ``edge_index`` ``[2, E + n]``, ``edge_weight`` ``[E + n]``

        Returns:
            ``(edge_index, edge_weight)`` with ``w(j -> i) = 1 / sqrt((deg_i + 1)(deg_j + 1))``, as
            PyG's ``gcn_norm`` on the whole graph.
        """
        deg = torch.cat([self.in_degree, halo_degree.view(-1).float()]) + 1.0
        inv_sqrt = deg.pow(-0.5)
        loops = torch.arange(self.num_owned).repeat(2, 1)
        ei = torch.cat([self.edge_index, loops], dim=1)
        return ei, inv_sqrt[ei[0]] * inv_sqrt[ei[1]]
