"""The planned optimizer's parameters as its plans take them (_planned): their order,
groups, device and dtypes checked once, where each one's data lies (what a step
compares to notice `p.data = ...`), and what DTensor parameters need of the ranks
(the shards' process group; which rank counts each piece in a norm)."""
import operator

import torch

from gradkit.torch._device import common_device
from gradkit.torch._dtensor import check_placements, counted_pieces, is_dtensor, local, shard_group
from gradkit.torch._state_forms import LOW_PRECISION


def _data_key(t):
    """Where a tensor's data is and how it is laid out: what a step compares to notice
    `p.data = ...` (a new storage, or the same one seen through another shape)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class Layout:
    """The optimizer's parameters in param_groups order, with their group index, checked
    as gradkit's plans take them (named errors at construction, add_param_group and
    whenever a step finds the parameters changed)."""

    __slots__ = ("params", "group_of", "device", "masters", "dtensors", "data", "_shard_group", "_counted")

    def __init__(self, param_groups, mixed=False):
        self.params = [p for g in param_groups for p in g["params"]]
        self.group_of = [i for i, g in enumerate(param_groups) for _ in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        self.device = common_device(self.params, "params")
        if self.device.type not in ("cpu", "cuda", "meta"):
            raise TypeError(f"params are on {self.device}, expected the CPU or a CUDA device")
        dtypes = {p.dtype for p in self.params}
        # `mixed`: an optimizer whose cohorts are split by dtype (Muon) takes float32 and bfloat16
        # parameters together, as nanochat holds its embeddings in bfloat16 and the rest in float32.
        allowed = [{torch.float32}, {torch.float64}, {torch.float16}, {torch.bfloat16}]
        if mixed:
            allowed.append({torch.float32, torch.bfloat16})
        if dtypes not in allowed:
            raise TypeError(f"params have dtypes {sorted(str(d) for d in dtypes)}, expected one of float32, "
                            "float64, float16 or bfloat16 for all of them (float16/bfloat16 parameters get "
                            "float32 master weights)" + (", or float32 and bfloat16" if mixed else ""))
        self.masters = any(d in LOW_PRECISION for d in dtypes)
        # Whether a gradient may be a DTensor (whose local shard gradkit reads): without one, a
        # step reads each .grad as it is, half the host time of asking each whether it is.
        self.dtensors = any(is_dtensor(p) for p in self.params)
        check_placements(self.params)
        for i, p in enumerate(self.params):
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError(f"params[{i}] has layout {p.layout}, expected dense (torch.strided) parameters")
            if not local(p).is_contiguous():
                raise ValueError(f"params[{i}] is not contiguous (shape {tuple(p.shape)}, strides {p.stride()}); "
                                 "expected contiguous parameters (gradkit steps each one as a flat array: "
                                 "make it with .contiguous() before the optimizer, or p.data = p.data.contiguous())")
            if p.is_conj() or p.is_neg():
                raise ValueError(f"params[{i}] is a lazily conjugated or negated view; expected a plain tensor")
        self.data = [] if self.device.type == "meta" else [_data_key(local(p)) for p in self.params]
        self._shard_group = False  # not yet looked at
        self._counted = None

    def holds(self, params):
        """Whether `params` (what the groups hold now) are this layout's parameters, in order,
        each with the data it had when the layout was made."""
        return (len(params) == len(self.params) and all(map(operator.is_, params, self.params))
                and [_data_key(local(p)) for p in params] == self.data)

    def ends_hold(self, param_groups):
        """holds() for the first and last parameter alone: a flat-gradient step's O(1) look
        (a model moved or cast, or every weight clipped by `p.data = ...`, changes both)."""
        first, last = param_groups[0]["params"], param_groups[-1]["params"]
        return (bool(first) and bool(last) and first[0] is self.params[0] and last[-1] is self.params[-1]
                and sum(len(g["params"]) for g in param_groups) == len(self.params)
                and first[0].data_ptr() == self.data[0][0]
                and last[-1].data_ptr() == self.data[-1][0])

    def refuse_meta(self):
        if self.device.type == "meta":
            raise RuntimeError("params are on the meta device (deferred initialisation), with no data to step; "
                               "make the optimizer over the parameters once they have storage (model.to_empty("
                               "device=...) makes new parameters, which this optimizer does not hold)")

    def shard_group(self):
        """The process group the sharded DTensor parameters are split over (None: none is)."""
        if self._shard_group is False:
            self._shard_group = shard_group(self.params)
        return self._shard_group

    def counted_pieces(self):
        """(group, counted): the process group of every rank and, per parameter, whether
        this rank's piece counts in a sum over the model (_dtensor.counted_pieces); (None,
        None) without DTensors. Made once per layout."""
        if self._counted is None:
            self._counted = counted_pieces(self.params)
        return self._counted
