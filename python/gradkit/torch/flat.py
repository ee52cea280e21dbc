"""A model's gradients as views into one gradkit GradientArena."""
import torch

import gradkit
from gradkit.torch._device import common_device, device_name, gradkit_dtype, stream_handle


class FlatGradients:
    """Every parameter's .grad becomes a view into one allocation (a gradkit
    GradientArena), so that an optimizer plan and an all-reduce each cover the
    whole model in one launch, and a step need not look at each .grad.

    Backward accumulates into the views in place (autograd adds into an
    existing .grad). Zero them with zero_() or the gradkit optimizer's
    zero_grad(), which keep the views; model.zero_grad() or
    zero_grad(set_to_none=True) on a torch optimizer sets .grad to None, and
    the next backward makes ordinary tensors again (gradkit's optimizers notice
    and fall back to reading each .grad). Every parameter has a gradient every
    step (zeros if it took no part), as with zero_grad(set_to_none=False).
    """

    def __init__(self, params, alignment=256, layout=None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params holds no parameter that requires a gradient")
        self.device = common_device(self.params, "params")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"params have dtypes {sorted(str(d) for d in dtypes)}, expected one dtype "
                            "(one arena holds one dtype)")
        dtype = gradkit_dtype(self.params[0].dtype, "params[0]")
        if layout is not None:  # a sharded optimizer's layout (gradkit.ShardedLayout)
            self.arena = gradkit.GradientArena(device_name(self.device), dtype, layout)
        else:
            self.arena = gradkit.GradientArena(device_name(self.device), dtype, [p.numel() for p in self.params],
                                               alignment)
        self.flat = torch.from_dlpack(self.arena.flat())
        self.views = [torch.from_dlpack(a).view(p.shape) for a, p in zip(self.arena.gradients(), self.params)]
        # Planned once (zeroing costs one launch, no table upload), over gradkit's own array: gradkit
        # holds no torch tensor (one whose last owner is C++ when Python exits is never freed).
        self._zero = gradkit.ZeroPlan([self.arena.flat()])
        self.attach()

    def attach(self):
        """Makes every parameter's .grad its view again (an existing gradient is copied in)."""
        with torch.no_grad():
            for p, v in zip(self.params, self.views):
                if p.grad is not None and p.grad is not v:
                    v.copy_(p.grad)
                p.grad = v

    def attached(self):
        """Whether every parameter's .grad is still its view (reads each .grad)."""
        return all(p.grad is v for p, v in zip(self.params, self.views))

    def attached_cheap(self):
        """The first and last parameter's .grad are still their views: what a step checks
        (zero_grad(set_to_none=True) and model.zero_grad() detach all of them)."""
        return self.params[0].grad is self.views[0] and self.params[-1].grad is self.views[-1]

    def zero_(self):
        """Zeroes every gradient in one launch on the current stream."""
        self._zero.run(stream=stream_handle(self.device))
        return self


def flat_gradients(model_or_params, optimizer=None, alignment=256):
    """Puts the gradients of `model_or_params` (an nn.Module or parameters) into one
    gradkit GradientArena and returns the FlatGradients. With `optimizer` (a gradkit
    optimizer over the same parameters) its steps use them without reading each .grad."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    flat = FlatGradients(list(params), alignment)
    if optimizer is not None:
        optimizer.use_flat_gradients(flat)
    return flat
