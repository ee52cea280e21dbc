"""gradkit's communicators for PyTorch: made from a torch.distributed process
group (so a script started by torchrun needs no MPI), list collectives and
Adasum on torch tensors on torch's current CUDA stream, DDP communication
hooks, and an all-reduce of a model's gradients for loops without DDP.

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    comm = gradkit.torch.distributed.from_process_group()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[...])
    ddp.register_comm_hook(comm, gradkit.torch.distributed.all_reduce_hook)   # or adasum_hook

Collectives are enqueued and return at once; like torch's NCCL work they
complete in stream order. comm.wait() blocks until this rank's work on the
current stream has finished and raises after the communicator's timeout, or
when a peer failed (the communicator is then aborted): call it where a loop
must notice a dead or stuck rank. With blocking calls (from_process_group's
default) a watchdog thread also ends work stuck past the timeout, as torch's
does, so that a loop that only synchronizes through torch does not hang.
"""
import collections

import torch

import gradkit
from gradkit.torch._device import stream_handle
from gradkit.torch.flat import FlatGradients

if not hasattr(gradkit, "Communicator"):
    raise ImportError("gradkit was built without its communication layer (MPI was not found when it was built)")

_OPS = {"sum": gradkit.ReduceOp.sum, "average": gradkit.ReduceOp.average, "avg": gradkit.ReduceOp.average}


def _reduce_op(op):
    try:
        return _OPS[op] if isinstance(op, str) else op
    except KeyError:
        raise ValueError(f"op is {op!r}, expected 'sum' or 'average'") from None


def _detached(tensors):
    """A tensor or a list of tensors as a list of detached tensors (what gradkit takes)."""
    return [t.detach() for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors)]


class Communicator:
    """A gradkit communicator for torch tensors. `comm` is a gradkit.Communicator
    (from from_process_group, or gradkit.create_*_communicator)."""

    MAX_ADASUM_PLANS = 1024  # lists remembered (a DDP model has one per bucket)

    def __init__(self, comm):
        self.comm = comm
        self.device = torch.device(comm.device)
        self._adasum_plans = collections.OrderedDict()
        self._side_stream = None

    @property
    def rank(self):
        return self.comm.rank

    @property
    def size(self):
        return self.comm.size

    def _stream(self):
        return stream_handle(self.device)

    def all_reduce(self, tensors, op="sum"):
        """Every element of every tensor (a tensor or a list) becomes the sum or
        average over ranks, in place."""
        self.comm.all_reduce(_detached(tensors), _reduce_op(op), stream=self._stream())

    def all_gather(self, tensors):
        """The list is the whole model on every rank, rank r owning its ShardLayout
        shard; each element becomes its owner's value (docs/ops.md)."""
        self.comm.all_gather(_detached(tensors), stream=self._stream())

    def reduce_scatter(self, tensors, op="sum"):
        """This rank's shard of the list's concatenation becomes the sum or average over ranks."""
        self.comm.reduce_scatter(_detached(tensors), _reduce_op(op), stream=self._stream())

    def adasum(self, tensors):
        """Every tensor becomes its Adasum over ranks (per tensor), in place. The plan
        is made once per list (where the tensors lie and their sizes) and kept."""
        tensors = _detached(tensors)
        key = tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors)
        plan = self._adasum_plans.get(key)
        if plan is None:
            if len(self._adasum_plans) >= self.MAX_ADASUM_PLANS:  # lists that keep moving: drop the oldest
                self._adasum_plans.popitem(last=False)
            plan = self._adasum_plans[key] = gradkit.AdasumPlan(self.comm, tensors)
        else:
            self._adasum_plans.move_to_end(key)
        plan.run(stream=self._stream())

    def side_stream(self):
        """The stream the DDP hooks run on, so that a bucket's reduction overlaps the
        rest of backward (as DDP's own all-reduce does)."""
        if self._side_stream is None and self.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(self.device, priority=-1)
        return self._side_stream

    def wait(self):
        """Blocks until this communicator's work on the current stream has finished;
        raises RuntimeError after the timeout or when a peer failed."""
        self.comm.wait(stream=self._stream())

    def barrier(self):
        self.comm.barrier()


def from_process_group(group=None, *, timeout=600.0, checked=False, device=None, blocking_calls=True):
    """A gradkit NCCL communicator over the ranks of an initialized torch.distributed
    process group: the group's rank 0 makes the NCCL unique id and the group
    broadcasts it (any backend: nccl or gloo). `device` is this rank's GPU (default:
    torch.cuda.current_device()); `timeout` in seconds bounds every wait.
    `blocking_calls`: gradkit.CommunicatorOptions.blocking_calls (docs/ops.md)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call torch.distributed.init_process_group first")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if index is None:
        raise ValueError(f"device is {device!r}, expected a CUDA device with an index, e.g. 'cuda:0'")
    source = 0 if group is None else dist.get_global_rank(group, 0)
    box = [gradkit.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=source, group=group)
    options = gradkit.CommunicatorOptions(timeout_s=timeout, checked=checked, cuda_device=index,
                                          blocking_calls=blocking_calls)
    with torch.cuda.device(index):
        return Communicator(gradkit.create_nccl_communicator(box[0], rank, size, options))


def _on_side_stream(comm, buffer, reduce):
    """Runs `reduce` on the communicator's side stream after the work enqueued so
    far on the current stream (backward's, which wrote the bucket), and returns
    the future DDP expects: its value is the bucket, ready in stream order (a
    CUDA-aware future records an event on the current stream, here the side
    stream, when its result is set; DDP's wait makes its stream wait on it)."""
    side = comm.side_stream()
    if side is None:  # the CPU: everything is complete when reduce returns
        reduce()
        future = torch.futures.Future()
        future.set_result(buffer)
        return future
    side.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(side):
        reduce()
        future = torch.futures.Future(devices=[buffer.device])
        future.set_result(buffer)
    return future


def all_reduce_hook(comm, bucket):
    """DDP communication hook: the bucket averaged over ranks by gradkit (one
    collective on the flat bucket, overlapping the rest of backward). Register
    with ddp.register_comm_hook(comm, all_reduce_hook)."""
    buffer = bucket.buffer()
    return _on_side_stream(comm, buffer, lambda: comm.all_reduce([buffer], "average"))


def adasum_hook(comm, bucket):
    """DDP communication hook: each gradient in the bucket becomes its Adasum over
    ranks (per tensor, as gradkit's Adasum treats a list), overlapping the rest
    of backward."""
    grads = bucket.gradients()
    return _on_side_stream(comm, bucket.buffer(), lambda: comm.adasum(grads))


def all_reduce_gradients(gradients, comm, op="average", adasum=False):
    """All-reduces the gradients of a loop without DDP: `gradients` is an
    nn.Module, parameters, or a gradkit.torch.FlatGradients (then one collective
    covers the whole arena). adasum=True combines per tensor by Adasum instead."""
    if isinstance(gradients, FlatGradients) and gradients.attached_cheap():
        if adasum:
            comm.adasum(gradients.views)
        else:
            gradients.arena.all_reduce(comm.comm, _reduce_op(op), stream=comm._stream())
        return
    params = gradients.parameters() if isinstance(gradients, torch.nn.Module) else \
        gradients.params if isinstance(gradients, FlatGradients) else gradients
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    if adasum:
        comm.adasum(grads)
    else:
        comm.all_reduce(grads, op)


__all__ = ["Communicator", "from_process_group", "all_reduce_hook", "adasum_hook", "all_reduce_gradients"]
