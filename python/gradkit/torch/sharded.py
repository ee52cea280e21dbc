"""AdamW with its state split across ranks (ZeRO stages 1 and 2), for
training loops without DDP: gradkit.ShardedAdam under a torch.optim.Optimizer.

    comm = gradkit.torch.distributed.from_process_group()   # or a gradkit communicator
    opt = gradkit.torch.ShardedAdamW(model.parameters(), comm, lr=1e-4, weight_decay=0.01)
    for batch in data:
        opt.zero_grad()
        loss_fn(model(batch)).backward()
        opt.step()      # reduce-scatter, check, AdamW on this rank's shard, all-gather

Do not all-reduce the gradients yourself: the step averages them over the
ranks (a reduce-scatter), and every rank ends the step with every weight.

The parameters' data and gradients move into two flat buffers laid out for
the ranks' shards (gradkit.ShardedLayout): each parameter's .data becomes a
view of the weight buffer and its .grad a view of the gradient buffer
(copied in, zero-copy from then on). Each rank keeps the moments (and for
float16/bfloat16 parameters the float32 master weights) of its shard only:
8 (12; 10 with master="remainder") bytes per parameter over the rank count,
where torch.optim.AdamW on every rank keeps 8 (and no masters). Every number
is computed by gradkit.

Stage 2 (torch 2.1 or newer): each bucket is reduce-scattered as soon as
backward has produced all of its gradients (post-accumulate-grad hooks), so
communication overlaps backward. Accumulating several backward passes into
one step: run the earlier ones inside `with opt.no_sync():`.

The state is saved and loaded with save(path)/load(path) (collective: every
rank calls them): one file in the unsharded optimizer's format, which loads
onto any number of ranks and into gradkit.MixedPrecisionAdam / gradkit.Adam.
state_dict() is refused: no rank holds the whole state.
"""
import contextlib
import weakref

import torch

import gradkit
from gradkit.torch import _compile
from gradkit.torch._dtensor import is_dtensor
from gradkit.torch._device import common_device, device_name, gradkit_dtype, stream_handle
from gradkit.torch._state_forms import StateForm
from gradkit.torch.flat import FlatGradients
from gradkit.torch._param_groups import adam_hyperparameters, closure_loss

if not hasattr(gradkit, "ShardedAdam"):
    raise ImportError("gradkit was built without its communication layer (MPI was not found when it was built)")


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW (PyTorch's decoupled weight decay) with its state split over the
    ranks of `comm`. `stage` 1 reduce-scatters every bucket in step(); 2 as
    backward finishes each. `bucket_elements`: elements per bucket (one
    reduce-scatter and one all-gather each). `max_norm` > 0 clips the global
    gradient norm (over every rank's shard). `update_parts`: the shard's
    update runs in at most this many launches, each part's buckets
    all-gathered while the next part is updated. `scaler` (a
    gradkit.LossScalerOptions) for float16 models whose loss is scaled:
    multiply the loss by `loss_scale_tensor`; steps with Inf/NaN gradients are
    skipped either way. `moments`: "float32", "bfloat16", "int8" or "int4" (8- or 4-bit
    blockwise, as gradkit.torch.AdamW's, for every parameter whatever its size; the shards
    then start on 256-element block boundaries); None takes `moment_dtype` (a torch dtype)
    instead. `master` for bfloat16
    parameters: "float32" (each rank keeps float32 masters of its shard, 4 bytes
    a parameter) or "remainder" (an int16 remainder completing each bfloat16
    weight of its shard, 2 bytes; the same masters bit for bit)."""

    def __init__(self, params, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 maximize=False, *, stage=1, bucket_elements=1 << 24, max_norm=0.0, scaler=None,
                 moment_dtype=torch.float32, update_parts=8, moments=None, master="float32"):
        if stage not in (1, 2):
            raise ValueError(f"stage is {stage!r}, expected 1 or 2")
        form = StateForm(master=master)  # refuses an unknown master form, naming it
        moment_type = self._moment_type(moments, moment_dtype)
        moment_bits = 4 if moments == "int4" else 8
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self.comm = getattr(comm, "comm", comm)  # gradkit.torch.distributed.Communicator, or gradkit's own
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            if is_dtensor(p):
                raise TypeError(f"params[{i}] is a DTensor: ShardedAdamW shards plain parameters itself; for "
                                "FSDP2's DTensor parameters use gradkit.torch.AdamW (it steps the local shards)")
        form.check(params, amsgrad=False)  # remainder: bfloat16 parameters only
        self._device = common_device(params, "params")
        if self._device != torch.device(self.comm.device):
            raise ValueError(f"params are on {self._device}, expected {self.comm.device} (the communicator's device)")
        dtype = gradkit_dtype(params[0].dtype, "params[0]")
        # 8- and 4-bit moments: every shard boundary on a quantization block's, so each rank holds whole
        # blocks (QUANT_BLOCK is a multiple of QUANT4_BLOCK).
        alignment = gradkit.QUANT_BLOCK if moment_type == gradkit.DType.u8 else 64
        self.layout = gradkit.ShardedLayout([p.numel() for p in params], self.comm.size, bucket_elements, alignment)
        self._weights = gradkit.GradientArena(device_name(self._device), dtype, self.layout)
        with torch.no_grad():
            views = [torch.from_dlpack(a).view(p.shape) for a, p in zip(self._weights.gradients(), params)]
            for p, v in zip(params, views):
                v.copy_(p)
                p.data = v
        self.gradients = FlatGradients(params, layout=self.layout)
        # gradkit's own arrays of the two arenas, not the torch views over them: gradkit then holds no
        # torch tensor (a torch tensor whose last owner is C++ when Python exits is never freed).
        weight_arrays, grad_arrays = self._weights.gradients(), self.gradients.arena.gradients()
        groups, at = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({"params": weight_arrays[at:at + n], "grads": grad_arrays[at:at + n],
                           "hyperparameters": self._hyperparameters(g)})
            at += n
        # On CUDA a side stream carries stage 2's reduce-scatters (overlapping
        # backward) and the step's all-gathers (overlapping the next bucket's
        # update); the step's stream waits for it before the step returns.
        self._side = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._sharded = gradkit.ShardedAdam(self.comm, self.layout, groups, scaler=scaler, max_norm=max_norm,
                                            moment_dtype=moment_type,
                                            communication_stream=self._side.cuda_stream if self._side else 0,
                                            update_parts=update_parts, moment_bits=moment_bits,
                                            master=gradkit.MasterStorage.remainder if master == "remainder"
                                            else gradkit.MasterStorage.f32)
        self._lrs = [float(g["lr"]) for g in self.param_groups]
        self._marking = True
        self._hooks = []
        if stage == 2:
            if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
                raise RuntimeError(f"stage 2 needs torch 2.1 or newer (Tensor.register_post_accumulate_grad_hook); "
                                   f"this is torch {torch.__version__}")
            # The hooks live on the parameters, in torch's C++ where the garbage collector does not look:
            # holding the optimizer there would make a cycle (parameter -> hook -> optimizer ->
            # param_groups -> parameter) that is never freed. They hold a weak reference, and go when
            # the optimizer does.
            me = weakref.ref(self)
            self._hooks = [p.register_post_accumulate_grad_hook(_ready_marker(me, i)) for i, p in enumerate(params)]
            weakref.finalize(self, _remove_hooks, self._hooks)

    @staticmethod
    def _moment_type(moments, moment_dtype):
        """gradkit's moment dtype from `moments` ("float32", "bfloat16", "int8", "int4", as
        gradkit.torch.AdamW's) or, when it is None, from the torch dtype `moment_dtype`."""
        if moments is None:
            return gradkit_dtype(moment_dtype, "moment_dtype")
        forms = {"float32": gradkit.DType.f32, "bfloat16": gradkit.DType.bf16, "int8": gradkit.DType.u8,
                 "int4": gradkit.DType.u8}
        if moments not in forms:
            raise ValueError(f"moments is {moments!r}, expected one of 'float32', 'bfloat16', 'int8', 'int4'")
        return forms[moments]

    @staticmethod
    def _hyperparameters(g):
        return adam_hyperparameters(g, gradkit.WeightDecay.decoupled)

    def add_param_group(self, param_group):
        if hasattr(self, "_sharded"):
            raise RuntimeError("ShardedAdamW lays out its parameters once; make a new optimizer to add a group")
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 2: backward passes inside do not start reduce-scatters (gradient accumulation)."""
        self._marking = False
        try:
            yield
        finally:
            self._marking = True

    def _reattach(self):
        """A .grad was replaced (model.zero_grad(set_to_none=True), say): back into the buffer,
        zeros where a parameter has no gradient."""
        with torch.no_grad():
            for p, v in zip(self.gradients.params, self.gradients.views):
                if p.grad is None:
                    v.zero_()
            self.gradients.attach()

    @_compile.eager_only  # under torch.compile: a graph break, the step run as it is
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter (average), check, AdamW on this rank's shard, loss scaler, all-gather."""
        loss = closure_loss(closure)
        if not self.gradients.attached_cheap():
            self._reattach()
        for i, g in enumerate(self.param_groups):
            lr = float(g["lr"])
            if lr != self._lrs[i]:  # an lr scheduler changed it
                self._sharded.set_lr(i, lr)
                self._lrs[i] = lr
        self._sharded.step(stream_handle(self._device))
        return loss

    def zero_grad(self, set_to_none=True):
        """Zeroes the gradient buffer in one launch; the .grad views stay (set_to_none is
        not honoured: the gradients must stay in the buffer)."""
        if not self.gradients.attached_cheap():
            self._reattach()
        self.gradients.zero_()

    def __getstate__(self):
        raise TypeError("ShardedAdamW cannot be copied or pickled: its state is split over the ranks of a "
                        "communicator; save it with save(path) (every rank calls it)")

    def state_dict(self):
        raise NotImplementedError("ShardedAdamW keeps its state split over the ranks: save it with save(path) "
                                  "(every rank calls it; one file in gradkit's unsharded format, loadable on any "
                                  "rank count) and load(path)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("ShardedAdamW loads its state with load(path) (see state_dict)")

    def save(self, path):
        """Every rank calls it; rank 0 writes the file (gradkit's unsharded format)."""
        self._sharded.save(str(path))

    def load(self, path):
        """Every rank calls it; nothing is loaded on any rank unless every rank can load.
        float16/bfloat16 parameters are rewritten from the loaded master weights."""
        self._sharded.load(str(path))
        self._lrs = [self._sharded.lr(i) for i in range(len(self.param_groups))]
        for g, lr in zip(self.param_groups, self._lrs):
            g["lr"] = lr

    @property
    def loss_scale(self):
        return self._sharded.loss_scale

    @property
    def loss_scale_tensor(self):
        """The loss scale as a one-element float32 tensor on the device (multiply the loss by it)."""
        return torch.from_dlpack(self._sharded.loss_scale_device)

    @property
    def last_step_skipped(self):
        return self._sharded.last_step_skipped

    @property
    def step_count(self):
        return self._sharded.step_count

    @property
    def state_bytes(self):
        """Bytes of optimizer state (moments, masters) this rank holds."""
        return self._sharded.state_bytes


def _ready_marker(optimizer_ref, index):
    """Stage 2's hook for the parameter at `index`: its gradient is final, its bucket may go."""
    def mark(_param):
        opt = optimizer_ref()
        if opt is not None and opt._marking:
            opt._sharded.mark_ready(index, stream_handle(opt._device))
    return mark


def _remove_hooks(handles):
    for h in handles:
        h.remove()
