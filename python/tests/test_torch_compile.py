"""gradkit.torch's steps inside torch.compile (gradkit.torch._compile: one
custom operator, gradkit::step_): the compiled step equals the eager step bit
for bit over 20 steps, for AdamW, Lamb, AmpStep (with a skipped step), int8
moments and int4 ones (AdamW's and Lamb's); called from a compiled function
alone, with fullgraph=True, inside a compiled training step (forward and backward too), over flat
gradients, with an LR scheduler (no recompilation, the rate a float or a
tensor), and with mode="reduce-overhead" (CUDA graphs) on a GPU. The
operator refuses copies of the parameters rather than stepping them."""
import pytest

torch = pytest.importorskip("torch")

import gradkit.torch as gt  # noqa: E402
from gradkit.torch import _compile  # noqa: E402

pytestmark = pytest.mark.skipif(not _compile.AVAILABLE,
                                reason=f"torch {torch.__version__} has no torch.library.register_fake (2.4+)")

STEPS = 20


def model_and_data(device, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 8)).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g).to(device, dtype), torch.randn(16, 8, generator=g).to(device, dtype))
            for _ in range(4)]
    return model, data


OPTIMIZERS = {
    "AdamW": lambda params: gt.AdamW(params, lr=1e-2, weight_decay=0.1),
    "Lamb": lambda params: gt.Lamb(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
    "AdamW int8": lambda params: gt.AdamW(params, lr=1e-2, moments="int8", min_8bit_size=1024),
    "AdamW int4": lambda params: gt.AdamW(params, lr=1e-2, moments="int4", min_4bit_size=1024),
    "Lamb int4": lambda params: gt.Lamb(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, moments="int4",
                                        min_4bit_size=1024),
    "Muon": lambda params: gt.Muon(matrices_and_the_rest(params), lr=2e-2),
}


def matrices_and_the_rest(params):
    """Muon's groups: the weight matrices, and the biases with AdamW."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim == 2]},
            {"params": [p for p in params if p.ndim != 2], "use_muon": False, "lr": 1e-2}]


def train(device, make_optimizer, how, steps=STEPS, amp=False, inf_at=None, flat=False):
    """The weights after `steps` steps; `how`: "eager", "step" (the step compiled alone),
    "fullgraph" (the same, fullgraph=True), "train" (forward, backward and step in one
    compiled function), "backward" (forward and backward compiled, the step eager: what
    "train" must equal, since Inductor's forward and backward round otherwise than
    eager's), "reduce-overhead" (the step under CUDA graphs). `amp`: the step is
    AmpStep's; `inf_at`: a step whose gradient gets an Inf (AmpStep skips it)."""
    torch._dynamo.reset()
    model, data = model_and_data(device)
    opt = make_optimizer(model.parameters())
    stepper = gt.AmpStep(opt, max_norm=1.0, init_scale=2.0 ** 10) if amp else opt
    if flat:
        gt.flat_gradients(model, opt)

    def loss_of(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        return stepper.scale(loss) if amp else loss

    def step():
        stepper.step()

    def train_step(x, y):
        loss_of(x, y).backward()
        stepper.step()

    def backward(x, y):
        loss_of(x, y).backward()

    compiled = {"step": lambda: torch.compile(step),
                "fullgraph": lambda: torch.compile(step, fullgraph=True),
                "reduce-overhead": lambda: torch.compile(step, mode="reduce-overhead"),
                "train": lambda: torch.compile(train_step),
                "backward": lambda: torch.compile(backward)}
    run = compiled[how]() if how in compiled else None
    skipped = []
    for i in range(steps):
        x, y = data[i % len(data)]
        opt.zero_grad()
        if how in ("train", "backward"):
            if inf_at == i:
                x = x.clone()
                x[0, 0] = float("inf")
            run(x, y)
            if how == "backward":
                step()
        else:
            loss_of(x, y).backward()
            if inf_at == i:
                next(model.parameters()).grad.view(-1)[3] = float("inf")
            (run or step)()
        if amp:
            skipped.append(stepper.found_inf)
    weights = [p.detach().clone() for p in model.parameters()]
    return weights, skipped


def assert_same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"parameter {i}: {(x - y).abs().max().item()} apart"


@pytest.mark.parametrize("how", ["step", "fullgraph", "train"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_compiled_step_equals_the_eager_one(device, name, how):
    eager, _ = train(device, OPTIMIZERS[name], "backward" if how == "train" else "eager")
    compiled, _ = train(device, OPTIMIZERS[name], how)
    assert_same(compiled, eager)


@pytest.mark.parametrize("how", ["step", "fullgraph", "train"])
def test_a_compiled_amp_step_skips_as_the_eager_one(device, how):
    eager, eager_skips = train(device, OPTIMIZERS["AdamW"], "backward" if how == "train" else "eager", amp=True,
                               inf_at=7)
    compiled, skips = train(device, OPTIMIZERS["AdamW"], how, amp=True, inf_at=7)
    assert eager_skips[7] and sum(eager_skips) == 1, eager_skips
    assert skips == eager_skips
    assert_same(compiled, eager)


def test_compiled_over_flat_gradients(device):
    eager, _ = train(device, OPTIMIZERS["AdamW"], "eager", flat=True)
    compiled, _ = train(device, OPTIMIZERS["AdamW"], "fullgraph", flat=True)
    assert_same(compiled, eager)


@pytest.mark.parametrize("lr", ["float", "tensor"])
def test_an_lr_scheduler_recompiles_nothing(device, lr):
    """The step reads the learning rates when it runs: a scheduler changing them every step,
    a float (which makes torch's compiled optimizers recompile) or a tensor (torch's recipe),
    leaves one graph. The step and the scheduler in one compiled function, not fullgraph:
    torch's scheduler wraps optimizer.step in code Dynamo skips (for torch's optimizers too);
    the step's own frame is compiled."""
    from torch._dynamo.utils import counters

    def run(compiled):
        torch._dynamo.reset()
        model, data = model_and_data(device)
        opt = gt.AdamW(model.parameters(), lr=torch.tensor(1e-2) if lr == "tensor" else 1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))

        def step():
            opt.step()
            sched.step()

        run_step = torch.compile(step) if compiled else step
        graphs = []
        for i in range(STEPS):
            x, y = data[i % len(data)]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            run_step()
            graphs.append(counters["stats"]["unique_graphs"])
        return [p.detach().clone() for p in model.parameters()], graphs

    eager, _ = run(False)
    counters.clear()
    calls = _compile.graph_calls
    compiled, graphs = run(True)
    assert_same(compiled, eager)
    assert _compile.graph_calls - calls == STEPS  # every step ran as gradkit::step_ in a graph
    assert graphs[1] == graphs[-1], graphs  # the lr changed every step and nothing was compiled again


def test_copies_of_the_parameters_are_refused():
    model, data = model_and_data("cpu")
    opt = gt.AdamW(model.parameters())
    torch.nn.functional.mse_loss(model(data[0][0]), data[0][1]).backward()
    params = [p.detach().clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="other tensors than its parameters"):
        torch.ops.gradkit.step_(params, [p.grad for p in model.parameters()], [], opt._graph_handle)
    assert_same([p.detach() for p in model.parameters()], before)  # nothing written


@pytest.mark.parametrize("amp", [False, True], ids=["AdamW", "AmpStep"])
def test_reduce_overhead_equals_eager(amp):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    eager, eager_skips = train("cuda", OPTIMIZERS["AdamW"], "eager", amp=amp, inf_at=7 if amp else None)
    compiled, skips = train("cuda", OPTIMIZERS["AdamW"], "reduce-overhead", amp=amp, inf_at=7 if amp else None)
    assert skips == eager_skips
    assert_same(compiled, eager)


SHARDED_SCRIPT = """
import sys, torch, gradkit
import gradkit.torch as gt, gradkit.torch.distributed as gtd

def run(comm, compiled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = gt.ShardedAdamW(model.parameters(), comm, lr=1e-2)
    step = torch.compile(opt.step) if compiled else opt.step
    for i in range(5):
        opt.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        step()
    return [p.detach().clone() for p in model.parameters()]

with gradkit.MpiEnvironment():
    comm = gtd.Communicator(gradkit.create_mpi_communicator(gradkit.CommunicatorOptions(timeout_s=60)))
    same = all(torch.equal(a, b) for a, b in zip(run(comm, False), run(comm, True)))
    del comm
print("same" if same else "differ")
"""


@pytest.mark.mpi
def test_steps_left_out_of_graphs_run_as_they_are(tmp_path):
    """ShardedAdamW's step (collectives, host waits: the offloaded optimizers' are alike) is not
    put in a graph (gradkit.torch._compile.eager_only): compiled, it equals the eager step bit
    for bit (one rank, MPI)."""
    import os
    import subprocess
    import sys

    import gradkit
    if not gradkit.has_mpi_communicator():
        pytest.skip("gradkit was built without MPI (the one-rank communicator here is MPI's)")
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("same"), done.stdout[-2000:] + done.stderr[-4000:]


DTENSOR_SCRIPT = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
import gradkit.torch as gt
model = torch.nn.Linear(8, 8)
fully_shard(model)
opt = gt.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(2, 8)).sum().backward()
before = [p.full_tensor().clone() for p in model.parameters()]
try:
    torch.compile(opt.step)()
    print("stepped")
except NotImplementedError as e:
    same = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    print("refused:", e, "| unchanged" if same else "| CHANGED")
dist.destroy_process_group()
"""


def test_dtensor_parameters_are_refused_inside_a_graph(tmp_path):
    """FSDP2's DTensor parameters inside a compiled step: a NotImplementedError naming the
    remedy, nothing written (one rank, gloo)."""
    import os
    import subprocess
    import sys

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no FSDP2")
    from test_torch_distributed import free_port
    script = tmp_path / "dtensor.py"
    script.write_text(DTENSOR_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "refused: gradkit's step over DTensor parameters (FSDP2) is not supported inside torch.compile; " \
           "compile the model and call the step outside it | unchanged" in done.stdout, done.stdout
