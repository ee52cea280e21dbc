"""The gradient check (overflow, norm, clip divisor) over what an optimizer's last prepared
step covers: AmpStep's, and LAMB's own clipping."""
import gradkit
from gradkit.torch._dtensor import RankRows


class GradientCheck:
    """gradkit's GradientCheckPlan over the gradients an optimizer's last prepared
    step covers, kept pointing at them: made anew when the optimizer's cohorts
    are, re-pointed (in stream order) when only the gradients moved. Over
    sharded DTensor gradients each rank checks its shards and the ranks'
    partials are combined (every rank gets the same flag, norm and divisor)."""

    def __init__(self, optimizer, **options):
        self.optimizer = optimizer
        self.options = options
        self.plan = None
        self.versions = None
        self.partials = None  # RankRows of the shards' partials (sharded DTensor gradients)

    def check(self, stream, **outputs):
        opt = self.optimizer
        versions = (opt._cohort_version, opt._pointer_version)
        if self.plan is None or versions[0] != self.versions[0]:
            self.plan = gradkit.GradientCheckPlan(opt.present_grads(), hold_grads=False, **self.options)
        elif versions[1] != self.versions[1]:
            self.plan.set_grads(opt.present_grads(), hold_grads=False, stream=stream)
        self.versions = versions
        layout = opt._get_layout()
        group = layout.shard_group()
        if group is None:
            self.plan.check(stream=stream, **outputs)
            return
        if self.partials is None:
            self.partials = RankRows(group, 2, layout.device)
        self.plan.check(partial=self.partials.mine, stream=stream)
        self.partials.gather()
        self.plan.combine(self.partials.rows, self.partials.count, stream=stream, **outputs)
