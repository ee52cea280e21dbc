"""gradkit's steps inside torch.compile: one custom operator, gradkit::step_.

Dynamo cannot trace into gradkit (a C++ module), and an optimizer's step
keeps host-side plans that it re-points when the gradients move. So a step
under torch.compile is one operator in the graph (torch.library.custom_op):
it takes the parameters it updates (declared mutated), their gradients, the
tensors a fused mixed-precision step writes for the caller (the loss scale,
found_inf, the norm: declared mutated), the groups' learning rates, and a
handle to the Python object that steps (an optimizer or an AmpStep), and its
implementation runs that object's eager step. Its fake implementation does
nothing: a step returns nothing, and what it changes is declared.

What the graph gets is decided by the optimizer's _init_group, which Dynamo
runs eagerly when it traces (as it does for torch.optim's optimizers): the
parameters that have a gradient and those gradients, the state of parameters
stepped for the first time made first. Dynamo guards every param group's
values, so a changed hyperparameter or a learning rate given as a float
makes a new graph (as for torch's optimizers); a learning rate given as a
tensor (lr=torch.tensor(1e-3)), which torch's LR schedulers fill in place,
keeps the graph: the operator reads the rates when it runs.

Under CUDA graphs (mode="reduce-overhead") the operator is not recorded: it
is tagged cudagraph_unsafe, and Inductor runs it between the graphs it
records, as an eager step (its host cost, independent of the graph). A
gradkit step recorded into a CUDA graph by other means replays the plans as
they were when recorded; gradkit refuses to re-plan during a recording
(the optimizer's _refuse_in_capture).

The operator checks that it was handed the optimizer's own parameters and
gradients, not copies (a clone made by functionalization would be updated
in vain): it raises rather than step something else.
"""
import itertools
import weakref

import torch

# PyTorch 2.4 brought torch.library.custom_op; before it gradkit's steps run eagerly only.
AVAILABLE = hasattr(getattr(torch, "library", None), "custom_op") and hasattr(getattr(torch, "compiler", None),
                                                                               "is_compiling")

_steppers = weakref.WeakValueDictionary()  # handle -> the object whose _step_in_graph runs
_handles = itertools.count(1)
graph_calls = 0  # how many times gradkit::step_ ran (the tests' witness that a step ran in a graph)
# The AmpSteps whose step() is being traced, innermost last: the optimizer's step() under
# them is the fused step (a list Dynamo tracks, where an attribute of the optimizer it cannot).
fused_callers = []


def register(stepper):
    """A handle for `stepper` (an optimizer or an AmpStep), kept for as long as it lives."""
    handle = next(_handles)
    _steppers[handle] = stepper
    return handle


def is_compiling():
    """Whether Dynamo is tracing the caller (False on a PyTorch without torch.compile)."""
    return AVAILABLE and torch.compiler.is_compiling()


def stepper(handle):
    try:
        return _steppers[handle]
    except KeyError:
        raise RuntimeError(f"a compiled graph called gradkit's step for an object (handle {handle}) that no longer "
                           "exists; compile again for the new optimizer") from None


if AVAILABLE:
    from typing import List  # custom_op reads the annotations; list[...] needs Python 3.9's typing at run time

    # Tagged unsafe for CUDA graphs: under mode="reduce-overhead" Inductor runs the step between
    # the graphs it records (graph partitions), eagerly, so that its plans may follow gradients
    # that moved; the graph before it and the one after it are replayed.
    _TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

    @torch.library.custom_op("gradkit::step_", mutates_args=("params", "outputs"), tags=_TAGS)
    def step_(params: List[torch.Tensor], grads: List[torch.Tensor], outputs: List[torch.Tensor],
              handle: int) -> None:
        """The step of the object registered as `handle`, over `params` and their `grads`;
        `outputs`: the tensors it writes for its caller besides the parameters (AmpStep's)."""
        global graph_calls
        graph_calls += 1
        stepper(handle)._step_in_graph(params, grads)

    @step_.register_fake
    def _(params, grads, outputs, handle):
        return None


def graph_step(optimizer):
    """What an optimizer's step() is under torch.compile (traced by Dynamo): its own step,
    or the fused step of the AmpStep whose step() called it."""
    caller = fused_callers[-1] if fused_callers and fused_callers[-1].optimizer is optimizer else None
    outputs = caller.graph_outputs() if caller is not None else []
    handle = caller._graph_handle if caller is not None else optimizer._graph_handle
    tensors = []
    optimizer._init_group(tensors)  # run eagerly by Dynamo: the present parameters, then their gradients
    half = len(tensors) // 2
    torch.ops.gradkit.step_(tensors[:half], tensors[half:], outputs, handle)
