"""Whatever the order in which a script imports gradkit and torch, it works,
exits 0, and its process holds one copy of each shared runtime (NCCL, the
CUDA runtime, OpenMP, libstdc++). Each order runs in a process of its own,
as a new user's script would: `import gradkit.torch` first once ended in
"free(): invalid pointer" (status 134) on a GPU machine with torch 2.11,
because libgradkit exported its copy of libstdc++'s code and torch's calls
ran through it (src/exports.map). test_exports checks the cause itself,
which a machine where the abort does not show still has."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

# Each order, then a step on each device there is: AdamW over a small model,
# so that the libraries the step needs (OpenMP on the CPU, the CUDA runtime)
# are loaded before the process reports its maps and exits.
ORDERS = {
    "gradkit.torch": "import gradkit.torch as gt\nimport torch",
    "gradkit, then torch": "import gradkit\nimport torch\nimport gradkit.torch as gt",
    "torch, then gradkit.torch": "import torch\nimport gradkit.torch as gt",
    "gradkit.torch.distributed": "import gradkit.torch.distributed\nimport gradkit.torch as gt\nimport torch",
}

WORK = """
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for device in devices:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(device)
    opt = gt.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64, device=device)).square().mean().backward()
    opt.step()
    assert torch.isfinite(model.weight).all()
runtimes = {}
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    for name in ("libnccl.so", "libcudart.so", "libgomp", "libstdc++.so", "libgradkit.so"):
        if name in os.path.basename(path):
            runtimes.setdefault(name, set()).add(os.path.realpath(path))
for name, paths in sorted(runtimes.items()):
    print(name, len(paths), " ".join(sorted(paths)))
print("devices", " ".join(devices))
"""


@pytest.mark.parametrize("order", ORDERS)
def test_every_import_order_exits_0_with_one_of_each_runtime(order):
    code = "import os\n" + ORDERS[order] + "\n" + WORK
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{order}: exit {done.returncode}\n{output[-4000:]}"
    assert "free()" not in output and "double free" not in output, output[-4000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("lib")]
    assert lines, done.stdout  # at least libstdc++ is mapped
    for name, count, *paths in lines:
        assert count == "1", f"{order}: {name} mapped from {count} files: {paths}"
