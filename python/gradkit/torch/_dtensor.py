"""DTensor parameters (FSDP2's fully_shard, tensor parallelism).

gradkit steps each parameter's local shard: the update of an element needs
only that element, so Adam and AdamW need nothing more. What needs a whole
tensor, or the whole model, becomes a collective over the process group
that the shards lie on, enqueued in stream order with no host
synchronization: LAMB's per-tensor sums of w^2 and d^2 (its trust ratios),
and the gradient check's norm and Inf/NaN flag (AmpStep, LAMB's clipping).
Each rank's partial sums are all-gathered in rank order and added by
gradkit in that order, so every rank gets the same bits, run after run.
"""
import torch

try:  # torch 2.5+
    from torch.distributed.tensor import DTensor
except ImportError:  # older torch: the private module, or no DTensor at all (torch 1.13)
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None
try:  # fully_shard over a tensor-parallel Shard(0) gives the rows this placement (not a Shard)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:
    _StridedShard = ()


def is_sharded(placement):
    """Whether a placement splits the tensor over its mesh dimension: Shard, and the
    strided shard that fully_shard gives a dimension tensor parallelism splits too."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """What gradkit reads and writes for `t`: a DTensor's local shard (the same
    memory), else `t` itself; None stays None."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def local_data_ptr(t):
    """local(t).data_ptr() without the cost of to_local() on a DTensor (a step reads it for
    every parameter): its local tensor is the same memory."""
    inner = getattr(t, "_local_tensor", None) if is_dtensor(t) else None
    return (inner if inner is not None else local(t)).data_ptr()


def check_placements(params, what="params"):
    """Refuses a DTensor whose local tensor is not what its update should
    change: Shard and Replicate placements are fine, a Partial one holds a
    summand of the values, not the values."""
    for i, p in enumerate(params):
        if not is_dtensor(p):
            continue
        for dim, placement in enumerate(p.placements):
            if not (is_sharded(placement) or placement.is_replicate()):
                raise ValueError(f"{what}[{i}] is a DTensor with a {type(placement).__name__} placement ({placement}) "
                                 f"on mesh dimension {dim} "
                                 f"of {p.device_mesh}; expected Shard or Replicate placements (a partial tensor "
                                 "holds a summand of each value: redistribute it to Shard or Replicate first)")


def shard_group(params, what="params"):
    """The process group over which the sharded DTensor parameters are split, or
    None where no parameter is sharded (every local tensor is then whole).
    Collectives over the shards need one layout: every parameter a DTensor on
    the same mesh with the same placements, sharded along one mesh dimension
    (FSDP2's fully_shard gives that); anything else is refused, naming it."""
    sharded = [i for i, p in enumerate(params) if is_dtensor(p) and any(is_sharded(pl) for pl in p.placements)]
    if not sharded:
        return None
    first = params[sharded[0]]
    mesh, placements = first.device_mesh, tuple(first.placements)
    for i, p in enumerate(params):
        if not is_dtensor(p) or p.device_mesh != mesh or tuple(p.placements) != placements:
            layout = f"a DTensor with placements {tuple(p.placements)} on {p.device_mesh}" if is_dtensor(p) \
                else "a plain tensor"
            raise ValueError(f"{what}[{i}] is {layout}, expected placements {placements} on {mesh} like "
                             f"{what}[{sharded[0]}]: LAMB's trust ratios and the gradient check's norm over "
                             "sharded parameters need every parameter sharded the same way")
    dims = [d for d, pl in enumerate(placements) if is_sharded(pl)]
    if len(dims) != 1:
        raise ValueError(f"{what}[{sharded[0]}] is sharded along mesh dimensions {dims} of {mesh}; expected one "
                         "sharded mesh dimension (the others Replicate)")
    return mesh.get_group(dims[0])


def local_box(p):
    """(offset, shape) of this rank's local piece of `p` in p's dimensions: DTensor's own
    answer for a DTensor, the whole tensor for a plain one."""
    if not is_dtensor(p):
        return (0,) * p.dim(), tuple(p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(int(x) for x in offset), tuple(int(x) for x in shape)


def _root_ranks(mesh):
    """The ranks of the mesh `mesh` was cut from (itself where it was not)."""
    if hasattr(mesh, "_get_root_mesh"):  # newer torch; older ones keep it in _mesh_resources
        root = mesh._get_root_mesh()
    else:
        from torch.distributed.device_mesh import _mesh_resources

        root = _mesh_resources.get_root_mesh(mesh)
    return tuple((root if root is not None else mesh).mesh.flatten().tolist())


def counted_pieces(params, what="params"):
    """Where the same values stand on several ranks, which copy counts in a sum over the
    model's elements (a gradient norm): the lowest rank's. A copy is a piece with the same
    box on another rank: a Replicate mesh dimension, a sub-mesh repeated along its mesh's
    other dimensions (fully_shard over one dimension of a 2-D mesh, for the parameters
    tensor parallelism leaves whole), or a plain tensor beside DTensors (on every rank).
    Returns the process group of every rank of the DTensors' mesh and, per parameter,
    whether this rank's piece counts; (None, None) without DTensors. Every rank's boxes
    travel once (an object all-gather); the parameters' mesh must span every rank of the
    default process group, as one mesh of a training job does."""
    if not any(is_dtensor(p) for p in params):
        return None, None
    import torch.distributed as dist

    ranks = {_root_ranks(p.device_mesh) for p in params if is_dtensor(p)}
    world = dist.get_world_size()
    if len(ranks) != 1 or sorted(next(iter(ranks))) != list(range(world)):
        raise ValueError(f"{what} are DTensors on meshes of ranks {sorted(ranks)}; a norm over them needs one mesh "
                         f"spanning every rank of the default process group ({world} ranks)")
    boxes = [local_box(p) for p in params]
    every = [None] * world
    dist.all_gather_object(every, boxes)
    me = dist.get_rank()
    return dist.group.WORLD, [min(r for r in range(world) if every[r][i] == box) == me for i, box in enumerate(boxes)]


class RankRows:
    """One float64 row per rank of `group`, all-gathered in rank order: this
    rank writes its row (`mine`), gather() fills `rows` (every rank's, rank 0
    first) on the current stream."""

    def __init__(self, group, length, device):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.count = dist.get_world_size(group)
        self.rows = torch.zeros(self.count * length, dtype=torch.float64, device=device)
        self.mine = torch.zeros(length, dtype=torch.float64, device=device)

    def gather(self):
        self._dist.all_gather_into_tensor(self.rows, self.mine, group=self.group)


__all__ = ["DTensor", "is_dtensor", "is_sharded", "local", "local_box", "check_placements", "shard_group",
           "counted_pieces", "RankRows"]
