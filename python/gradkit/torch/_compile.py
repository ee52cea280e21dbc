"""gradkit's steps inside torch.compile: one custom operator, gradkit::step_.

Dynamo cannot trace into gradkit (a C++ module), and an optimizer's step
keeps host-side plans that it re-points when the gradients move. So a step
under torch.compile is one operator in the graph (torch.library): it takes
the parameters it updates (declared mutated), their gradients, the tensors
a fused mixed-precision step writes for the caller (the loss scale,
found_inf, the norm: declared mutated) and a handle to the Python object
that steps (an optimizer or an AmpStep); its implementation runs that
object's eager step. Its fake implementation does nothing: a step returns
nothing, and what it changes is declared.

The traced code reads which parameters have a gradient, and those gradients
(Dynamo guards them: a gradient that appears or goes away makes a new
graph). Everything else the step needs (the learning rates, the other
hyperparameters, the state, made at a parameter's first step) the operator
reads when it runs, as the eager step does: an LR scheduler, with the rate
a float or a tensor, recompiles nothing.

Under CUDA graphs (mode="reduce-overhead") the operator is not recorded: it
is tagged cudagraph_unsafe, and Inductor runs it between the graphs it
records, as an eager step (its host cost, independent of the graph). Where
the operator is recorded all the same (torch before 2.8, which has no such
tag; a compiled step run inside the caller's own torch.cuda.graph), its
replays run the plans as they were when recorded and write the learning
rates of the recording; gradkit refuses to re-plan during that recording
(the optimizer's _refuse_in_capture). An eager step recorded by hand is
not covered by that refusal: its replays run the plans as they were when recorded.

The operator checks that it was handed the optimizer's own parameters, not
copies (a clone made by functionalization would be updated in vain): it
raises rather than step something else. It steps the gradients it was
handed.
"""
import atexit
import gc
import itertools
import weakref

import torch

from gradkit.torch._dtensor import is_dtensor

# PyTorch 2.4 brought torch.library.register_fake (and custom_op); before it gradkit's steps
# run eagerly only.
AVAILABLE = hasattr(getattr(torch, "library", None), "register_fake") and hasattr(getattr(torch, "compiler", None),
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


def _forget_graphs():
    """At exit, after a compiled graph ran gradkit's step: Dynamo's caches let go of what the
    graphs reference, the cycles that held are collected, and the optimizers and AmpSteps
    still alive let go of their gradkit objects (plans, scalers, device scalars). The
    objects of a script that compiled its step can otherwise outlive the interpreter's
    clearing of its globals, and nanobind reports each gradkit object as leaked
    (docs/python.md, "At exit"). Nothing steps after this."""
    torch._dynamo.reset()
    gc.collect()
    for stepper in list(_steppers.values()):
        stepper._release_native()


def eager_only(method):
    """For the steps gradkit does not put in a graph (the offloaded and sharded optimizers':
    their steps wait on host work and collectives): Dynamo calls them as they are, a graph
    break, instead of tracing into them."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)  # torch 2.1+
    return disable(method) if disable is not None else method


def stepper(handle):
    try:
        return _steppers[handle]
    except KeyError:
        raise RuntimeError(f"a compiled graph called gradkit's step for an object (handle {handle}) that no longer "
                           "exists; compile again for the new optimizer") from None


if AVAILABLE:
    # Defined with torch.library's lower layer rather than custom_op: the step's one kernel is
    # registered for the CPU and CUDA keys and the Autograd key falls through to it (the step
    # is not differentiable, and gradkit writes the parameters as its eager step does, without
    # bumping their version counters), which skips custom_op's autograd and ADInplaceOrView
    # wrappers, whose dispatch over a model's tensor list costs tens to hundreds of microseconds
    # a step. The schema declares what the step mutates. Tagged unsafe for CUDA graphs: under
    # mode="reduce-overhead" Inductor runs the step between the graphs it records (graph
    # partitions), eagerly, so that its plans may follow gradients that moved.
    _library = torch.library.Library("gradkit", "DEF")
    _library.define("step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] outputs, int handle) -> ()",
                    tags=(torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ())

    def _step(params, grads, outputs, handle):
        """The step of the object registered as `handle`, over `params` and their `grads`;
        `outputs`: the tensors it writes for its caller besides the parameters (AmpStep's)."""
        global graph_calls
        if graph_calls == 0:
            atexit.register(_forget_graphs)
        graph_calls += 1
        stepper(handle)._step_in_graph(params, grads)

    for _key in ("CPU", "CUDA"):
        _library.impl("step_", _step, _key)
    _library.impl("step_", torch.library.fallthrough_kernel, "Autograd")

    @torch.library.register_fake("gradkit::step_", lib=_library)
    def _(params, grads, outputs, handle):
        return None


def graph_step(optimizer):
    """What an optimizer's step() is under torch.compile (traced by Dynamo): its own step,
    or the fused step of the AmpStep whose step() called it."""
    caller = fused_callers[-1] if fused_callers and fused_callers[-1].optimizer is optimizer else None
    outputs = caller.graph_outputs() if caller is not None else []
    handle = caller._graph_handle if caller is not None else optimizer._graph_handle
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if any(is_dtensor(p) for p in params):
        raise NotImplementedError("gradkit's step over DTensor parameters (FSDP2) is not supported inside "
                                  "torch.compile; compile the model and call the step outside it")
    torch.ops.gradkit.step_(params, [p.grad for p in params], outputs, handle)
