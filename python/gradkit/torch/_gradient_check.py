"""The gradient check (overflow, norm, clip divisor) over what an optimizer's last prepared
step covers: AmpStep's, and LAMB's own clipping."""
import torch

import gradkit
from gradkit.torch._dtensor import RankRows


def _by_dtype(grads):
    """The positions of `grads` per dtype, in order of first appearance (a GradientCheckPlan
    takes one dtype)."""
    lists = {}
    for i, g in enumerate(grads):
        lists.setdefault(g.dtype, []).append(i)
    return list(lists.values())


class GradientCheck:
    """gradkit's GradientCheckPlan over the gradients an optimizer's last prepared
    step covers, kept pointing at them: made anew when the optimizer's cohorts
    are, re-pointed (in stream order) when only the gradients moved. Over
    sharded DTensor gradients each rank checks its shards and the ranks'
    partials are combined (every rank gets the same flag, norm and divisor).
    Gradients of several dtypes (gt.Muon's float32 and bfloat16 parameters) get
    a plan per dtype, whose partials are combined likewise."""

    def __init__(self, optimizer, **options):
        self.optimizer = optimizer
        self.options = options
        self.plans = None
        self.lists = None  # each plan's positions in present_grads()
        self.versions = None
        self.partials = None  # RankRows of the shards' partials (sharded DTensor gradients)
        self.dtype_partials = None  # the plans' partials, one after another (several dtypes, unsharded)

    def _lists_of(self, grads):
        return [[grads[i] for i in positions] for positions in self.lists]

    def check(self, stream, **outputs):
        opt = self.optimizer
        versions = (opt._cohort_version, opt._pointer_version)
        if self.plans is None or versions[0] != self.versions[0]:
            grads = opt.present_grads()
            self.lists = _by_dtype(grads)
            self.plans = [gradkit.GradientCheckPlan(g, hold_grads=False, **self.options) for g in self._lists_of(grads)]
        elif versions[1] != self.versions[1]:
            for plan, g in zip(self.plans, self._lists_of(opt.present_grads())):
                plan.set_grads(g, hold_grads=False, stream=stream)
        self.versions = versions
        layout = opt._get_layout()
        group = layout.shard_group()
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
            plan.check(partial=mine[2 * k:2 * k + 2], stream=stream)
        if group is not None:
            self.partials.gather()
        self.plans[0].combine(rows, total, stream=stream, **outputs)
