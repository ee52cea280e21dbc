"""Muon over DTensor matrices split over ranks (docs/python.md, "Muon across meshes"):
FSDP2's rows, tensor parallelism's rows and columns, 2-D FSDP x TP meshes, expert
stacks split by experts, any Shard placements on any mesh.

Newton-Schulz needs each whole matrix. The ranks that together hold one copy of a
parameter (the mesh dimensions it is sharded along; each Replicate dimension holds
another copy, which steps alike on its own ranks) form its exchange group. Each rank
gives gradkit.MuonShardedPlan where its piece lies: as row boundaries where every
rank holds whole rows of the matrix list in rank order (FSDP2), else as one block per
rank (rows by columns of a run of matrices), DTensor's own answer for each rank's
local shard. The plan gives each matrix an owner, and the step is its three parts
with all-to-alls over the exchange group between them.
"""
import math

import torch

import gradkit
from gradkit.torch._dtensor import is_dtensor, is_sharded, local_box

_EXCHANGE_GROUPS = {}  # (the mesh's ranks, its shape, the sharded dimensions) -> this rank's process group


def sharded_dims(p):
    """The mesh dimensions a DTensor is sharded along (none for a plain tensor)."""
    if not is_dtensor(p):
        return ()
    return tuple(d for d, pl in enumerate(p.placements) if is_sharded(pl))


def exchange_key(p):
    """What identifies p's exchange group on every rank alike (None: p is whole on each
    rank): the mesh's ranks and shape, and the dimensions p is sharded along."""
    dims = sharded_dims(p)
    if not dims:
        return None
    mesh = p.device_mesh
    return tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), dims


def exchange_group(p):
    """The process group of the ranks holding p's copy with this rank: the mesh group of
    its one sharded dimension, or for several one group per copy, made once for the whole
    mesh (every rank makes every group, in the same order, as torch.distributed asks)."""
    dims = sharded_dims(p)
    mesh = p.device_mesh
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    key = exchange_key(p)
    if key not in _EXCHANGE_GROUPS:
        import torch.distributed as dist

        kept = [d for d in range(mesh.mesh.ndim) if d not in dims]
        copies = mesh.mesh.permute(*kept, *dims).reshape(-1, math.prod(mesh.mesh.shape[d] for d in dims))
        mine, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in copies])
        _EXCHANGE_GROUPS[key] = mine
    return _EXCHANGE_GROUPS[key]


def _as_3d(offset, shape):
    """A 2-D matrix's box as a stack of one matrix's."""
    return ((0, *offset), (1, *shape)) if len(shape) == 2 else (offset, shape)


def row_splits(full_shape, boxes):
    """The ranks' boxes (in group rank order) as MuonShardedPlan's row boundaries over
    the matrix list's batch x rows rows, or None where some rank's piece is not whole
    rows in rank order (a column block, a block inside matrices)."""
    batch, rows, cols = (1, *full_shape) if len(full_shape) == 2 else full_shape
    splits = [0]
    for offset, shape in boxes:
        (b0, r0, c0), (nb, nr, nc) = _as_3d(offset, shape)
        if nb * nr * nc == 0:
            splits.append(splits[-1])
            continue
        if nc != cols or (nb > 1 and nr != rows) or b0 * rows + r0 != splits[-1]:
            return None
        splits.append(splits[-1] + nb * nr)
    return splits if splits[-1] == batch * rows else None


def matrix_block(full_shape, offset, shape, heads, what):
    """One rank's box as a MatrixBlock (batch_first, batches, row_first, rows, col_first,
    cols) of the matrices Muon orthogonalises: p's, or with `heads` each one's row
    blocks of rows / heads. A box that cuts across heads otherwise than on their
    boundaries (or inside one head) is refused, naming `what`."""
    (b0, r0, c0), (nb, nr, nc) = _as_3d(offset, shape)
    if nb * nr * nc == 0:
        return (0, 0, 0, 0, 0, 0)
    if heads is None or heads == 1:
        return (b0, nb, r0, nr, c0, nc)
    rows = full_shape[-2]
    per_head = rows // heads
    if r0 % per_head == 0 and nr % per_head == 0 and (nb == 1 or nr == rows):
        return (b0 * heads + r0 // per_head, nb * nr // per_head, 0, per_head, c0, nc)
    if nb == 1 and r0 // per_head == (r0 + nr - 1) // per_head:
        return (b0 * heads + r0 // per_head, 1, r0 % per_head, nr, c0, nc)
    raise ValueError(f"{what} holds rows {r0} to {r0 + nr} of {rows} on this rank, which cut across its heads of "
                     f"{per_head} rows (heads={heads}); per-head Muon over shards takes pieces of whole heads or "
                     "pieces inside one head")


def piece_layout(params, heads, group):
    """MuonShardedPlan's row_splits (a list per tensor) and blocks (a list per tensor of
    one block per rank of `group`): row_splits where every tensor's pieces are whole
    rows in rank order, else blocks. Every rank's boxes travel over `group` once (an
    object all-gather when the plan is made)."""
    import torch.distributed as dist

    mine = [local_box(p) for p in params]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    boxes = [[every[r][i] for r in range(len(every))] for i in range(len(params))]
    splits = [row_splits(tuple(p.shape), b) for p, b in zip(params, boxes)]
    if all(s is not None for s in splits):
        return splits, []
    blocks = [[matrix_block(tuple(p.shape), o, s, h, what) for o, s in b]
              for p, b, h, what in zip(params, boxes, heads, (f"a DTensor of shape {tuple(p.shape)}" for p in params))]
    return [], blocks


class Wrapping:
    """A cohort's plan behind another step: the gradients and hyperparameters go to
    the gradkit plan it wraps (self.plan)."""

    def set_grads(self, grads, hold_grads=False, stream=0):
        self.plan.set_grads(grads, hold_grads=hold_grads, stream=stream)

    def set_hyperparameters(self, hyperparameters, stream=None):
        self.plan.set_hyperparameters(hyperparameters, stream=stream)


class ShardedMuon(Wrapping):
    """A Muon cohort of DTensor matrices with one exchange group: MuonShardedPlan's
    three parts with the all-to-alls between them on that group, bucket by bucket.
    Each bucket's exchange is issued as soon as its momentum is written; its products
    start on the plan's side stream once it has arrived, while the next bucket's
    momentum and exchange run; its pieces go back and are updated as soon as its
    products are done, while the next bucket's products run. The exchange buffers are
    the plan's; they travel as bytes (the bf16 values' bits: every backend moves uint8,
    gloo included)."""

    def __init__(self, params, lists, shapes, heads, hyper, groups, buckets):
        import torch.distributed as dist

        self._dist = dist
        self.group = exchange_group(params[0])
        rank, ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
        splits, blocks = piece_layout(params, heads, self.group)
        self.plan = gradkit.MuonShardedPlan(*lists, shapes, splits, rank, ranks, hyper, groups, hold_grads=False,
                                            buckets=buckets, blocks=blocks)
        each = range(self.plan.num_buckets)
        self.shard = [torch.from_dlpack(self.plan.shard_buffer(k)).view(torch.uint8) for k in each]
        self.owner = [torch.from_dlpack(self.plan.owner_buffer(k)).view(torch.uint8) for k in each]
        self.shard_counts = [[2 * n for n in self.plan.shard_counts(k)] for k in each]
        self.owner_counts = [[2 * n for n in self.plan.owner_counts(k)] for k in each]

    def exchange(self, k, back=False):
        """Bucket k's all-to-all: the pieces to their owners, or (back) the owners' results
        to the pieces' ranks (over NCCL the current stream waits for it, not the host)."""
        if back:
            return self._dist.all_to_all_single(self.shard[k], self.owner[k], self.shard_counts[k],
                                                self.owner_counts[k], group=self.group)
        return self._dist.all_to_all_single(self.owner[k], self.shard[k], self.owner_counts[k], self.shard_counts[k],
                                            group=self.group)

    def step(self, found_inf=None, grad_scale_device=None, stream=0):
        # A plan of one bucket has nothing to overlap: its products run on the stream (the
        # side-stream path costs a 1-bucket step time of its own; measured:
        # bench/log/2026-11-26.md, "Muon's exchanges in buckets"). muon_sharded_step (C++)
        # runs the same order over a gradkit communicator.
        plan, buckets = self.plan, range(len(self.shard))
        beside = len(buckets) > 1
        for k in buckets:
            plan.momentum(k, found_inf=found_inf, grad_scale_device=grad_scale_device, stream=stream)
            self.exchange(k)
            if beside:
                plan.orthogonalize_beside(k, found_inf=found_inf, stream=stream)
            else:
                plan.orthogonalize(k, found_inf=found_inf, stream=stream)
        for k in buckets:
            if beside:
                plan.join(k, stream=stream)
            self.exchange(k, back=True)
            plan.update(k, found_inf=found_inf, stream=stream)
