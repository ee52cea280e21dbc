"""Run by test_comm.py under mpiexec (2, 3 or 4 ranks, the CPU): gradkit's
MPI communicator through the Python bindings on numpy arrays, against
float64 references that every rank computes from every rank's seeded
inputs. Exits non-zero on the first mismatch (mpiexec then fails)."""
import sys

import numpy as np

import gradkit

SHAPES = [7, 300, 1, 4099]


def rank_inputs(rank, dtype):
    rng = np.random.default_rng(1000 + rank)
    return [rng.standard_normal(n).astype(dtype) for n in SHAPES]


def adasum_pair(a, b):
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2 * aa) if aa > 0 else 1.0
    cb = 1.0 - dot / (2 * bb) if bb > 0 else 1.0
    return ca * a + cb * b


def adasum_reference(vectors):
    """docs/ops.md: fold the ranks past a power of two, then the binary tree, lower ranks as a."""
    p = 1
    while p * 2 <= len(vectors):
        p *= 2
    level = [adasum_pair(vectors[i], vectors[i + p]) if i + p < len(vectors) else vectors[i] for i in range(p)]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def check(name, got, want, rtol, atol):
    if not np.allclose(np.asarray(got, dtype=np.float64), want, rtol=rtol, atol=atol):
        err = np.max(np.abs(np.asarray(got, dtype=np.float64) - want))
        sys.exit(f"{name}: max abs error {err:g} beyond rtol {rtol} atol {atol}")


def main():
    with gradkit.MpiEnvironment():
        comm = gradkit.create_mpi_communicator(gradkit.CommunicatorOptions(timeout_s=60, checked=True))
        rank, size = comm.rank, comm.size
        assert comm.backend == "mpi" and comm.device == "cpu", (comm.backend, comm.device)
        everyone = [rank_inputs(r, np.float64) for r in range(size)]
        total = [sum(x[i] for x in everyone) for i in range(len(SHAPES))]

        for dtype, tol in ((np.float32, (1e-6, 1e-6)), (np.float64, (1e-13, 1e-13))):
            mine = rank_inputs(rank, dtype)
            comm.all_reduce(mine, gradkit.ReduceOp.sum)
            for i, t in enumerate(mine):
                check(f"all_reduce sum {dtype.__name__} [{i}]", t, total[i], *tol)
            mine = rank_inputs(rank, dtype)
            out = [np.empty_like(t) for t in mine]
            comm.all_reduce(mine, gradkit.ReduceOp.average, outputs=out)
            for i, t in enumerate(out):
                check(f"all_reduce average {dtype.__name__} [{i}]", t, total[i] / size, *tol)
            for i, t in enumerate(mine):  # out of place: the inputs are left as they were
                check(f"all_reduce input kept [{i}]", t, rank_inputs(rank, np.float64)[i], *tol)

        # reduce-scatter then all-gather of the list gives the all-reduce.
        mine = rank_inputs(rank, np.float32)
        comm.reduce_scatter(mine, gradkit.ReduceOp.sum)
        comm.all_gather(mine)
        for i, t in enumerate(mine):
            check(f"reduce_scatter + all_gather [{i}]", t, total[i], 1e-6, 1e-6)

        # The arena: one collective over every gradient.
        arena = gradkit.GradientArena("cpu", gradkit.DType.f32, SHAPES)
        # numpy's DLPack import is read-only: gradkit's accumulate fills the (zeroed) arena.
        gradkit.AccumulatePlan(arena.gradients(), rank_inputs(rank, np.float32)).accumulate()
        views = [np.from_dlpack(g) for g in arena.gradients()]
        arena.all_reduce(comm, gradkit.ReduceOp.average)
        for i, v in enumerate(views):
            check(f"GradientArena.all_reduce [{i}]", v, total[i] / size, 1e-6, 1e-6)

        # Adasum per tensor.
        mine = rank_inputs(rank, np.float64)
        plan = gradkit.AdasumPlan(comm, mine)
        plan.run()
        for i, t in enumerate(mine):
            check(f"Adasum [{i}]", t, adasum_reference([x[i] for x in everyone]), 1e-12, 1e-12)

        # Checked mode: a call that differs between ranks fails on every rank, naming the difference.
        shapes = [5] if rank == 0 else [6]
        try:
            comm.all_reduce([np.ones(n, dtype=np.float32) for n in shapes])
            sys.exit("a mismatched all_reduce did not raise")
        except ValueError as e:
            if "differs between ranks" not in str(e) or "5 elements on rank 0" not in str(e):
                sys.exit(f"the mismatch error does not say what differs: {e}")

        # Bad input: a clear error naming the argument, nothing written.
        try:
            comm.all_reduce([np.ones((2, 3), dtype=np.float32).T])
            sys.exit("a non-contiguous tensor was accepted")
        except (ValueError, TypeError) as e:
            if "tensors[0]" not in str(e):
                sys.exit(f"the error does not name the argument: {e}")
        comm.barrier()
        del plan, comm
    print(f"rank {rank} of {size}: ok", flush=True)


if __name__ == "__main__":
    main()
