"""The gradient check (overflow, norm, clip divisor) over what an optimizer's last prepared
step covers: AmpStep's, and LAMB's own clipping."""
import torch

import gradkit
from gradkit.torch._dtensor import RankRows


def _by_dtype(grads, counted=None):
    """The positions of `grads` per dtype, in order of first appearance (a GradientCheckPlan
    takes one dtype); with `counted`, only the positions it marks, each dtype's list kept
    (perhaps empty) so that every rank has as many lists."""
    lists = {}
    for i, g in enumerate(grads):
        lists.setdefault(g.dtype, [])
        if counted is None or counted[i]:
            lists[g.dtype].append(i)
    return list(lists.values())


class GradientCheck:
    """gradkit's GradientCheckPlan over the gradients an optimizer's last prepared
    step covers, kept pointing at them: made anew when the optimizer's cohorts
    are, re-pointed (in stream order) when only the gradients moved. Over DTensor
    gradients each rank checks the pieces it counts (each piece's lowest rank among
    those holding it: _dtensor.counted_pieces) and every rank's partials, all-gathered
    and added in rank order, give each rank the same flag, norm and divisor, each
    element counted once on any mesh. Gradients of several dtypes (gt.Muon's float32
    and bfloat16 parameters) get a plan per dtype, whose partials are combined
    likewise."""

    def __init__(self, optimizer, **options):
        self.optimizer = optimizer
        self.options = options
        self.plans = None  # per dtype; None where this rank counts none of its gradients
        self.combiner = None  # the plan whose combine() gives the outputs
        self.lists = None  # each plan's positions in present_grads()
        self.versions = None
        self.partials = None  # RankRows of the ranks' partials (DTensor gradients)
        self.dtype_partials = None  # the plans' partials, one after another (several dtypes, no DTensors)

    def _lists_of(self, grads):
        return [[grads[i] for i in positions] for positions in self.lists]

    def _make_plans(self, grads, counted):
        present = None if counted is None else [counted[i] for i in self.optimizer.present_indices()]
        self.lists = _by_dtype(grads, present)
        self.plans = [gradkit.GradientCheckPlan(g, hold_grads=False, **self.options) if g else None
                      for g in self._lists_of(grads)]
        self.combiner = next((p for p in self.plans if p is not None), None)
        if self.combiner is None:  # this rank counts no piece: a plan of its own for combine()
            self.combiner = gradkit.GradientCheckPlan([g for g in grads if g.dtype == grads[0].dtype],
                                                      hold_grads=False, **self.options)
        if self.partials is not None:
            self.partials.mine.zero_()  # the slots of lists this rank counts nothing of

    def check(self, stream, **outputs):
        opt = self.optimizer
        versions = (opt._cohort_version, opt._pointer_version)
        layout = opt._get_layout()
        group, counted = layout.counted_pieces()
        if self.plans is None or versions[0] != self.versions[0]:
            self._make_plans(opt.present_grads(), counted)
        elif versions[1] != self.versions[1]:
            for plan, g in zip(self.plans, self._lists_of(opt.present_grads())):
                if plan is not None:
                    plan.set_grads(g, hold_grads=False, stream=stream)
        self.versions = versions
        count = len(self.plans)
        if group is None and count == 1:
            self.plans[0].check(stream=stream, **outputs)
            return
        if group is None:
            if self.dtype_partials is None or self.dtype_partials.numel() != 2 * count:
                self.dtype_partials = torch.zeros(2 * count, dtype=torch.float64, device=layout.device)
            rows, total = self.dtype_partials, count
            mine = rows
        else:
            if self.partials is None or self.partials.mine.numel() != 2 * count:
                self.partials = RankRows(group, 2 * count, layout.device)
            mine, rows, total = self.partials.mine, self.partials.rows, self.partials.count * count
        for k, plan in enumerate(self.plans):
            if plan is not None:
                plan.check(partial=mine[2 * k:2 * k + 2], stream=stream)
        if group is not None:
            self.partials.gather()
        self.combiner.combine(rows, total, stream=stream, **outputs)
