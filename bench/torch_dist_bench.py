#!/usr/bin/env python3
"""torch.distributed's side of gradkit-bench-comm: the same collectives on the
same sizes over the NCCL backend, timed the same way (CUDA events around each
call, ranks synchronized before each rep, per rep the slowest rank, median).

Run under the same launcher as the bench, one process per GPU:
  mpiexec -n N python3 bench/torch_dist_bench.py --init-file /tmp/x --out results.txt
Rank and world size come from Open MPI's (or torchrun's) environment. Rank 0
writes "<key> <ms>" lines to --out, which gradkit-bench-comm reads with
--torch-results. Exits 3 when torch is not importable.
"""
import argparse
import os
import statistics
import sys


def env_int(*names, default=None):
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    if default is None:
        raise SystemExit("torch_dist_bench.py: none of %s is set (run it under mpiexec or torchrun)" % ", ".join(names))
    return default


def bert_large_sizes():
    """BERT-large's 389 parameter tensors, as tools/gradkit/workloads.cc lists them."""
    hidden, intermediate, vocab, positions, types = 1024, 4096, 30522, 512, 2
    sizes = [vocab * hidden, positions * hidden, types * hidden, hidden, hidden]
    for _ in range(24):
        for _ in range(4):
            sizes += [hidden * hidden, hidden]
        sizes += [hidden, hidden, intermediate * hidden, intermediate, hidden * intermediate, hidden, hidden, hidden]
    assert len(sizes) == 389 and sum(sizes) == 334092288
    return sizes


def zero_rows(record, device, rank, world):
    """ZeroRedundancyOptimizer(AdamW, fused) on BERT-large's f32 parameters, after
    the all-reduce it needs (DDP's), and the parts a sharded step is made of:
    reduce-scatter and all-gather of the whole list, fused AdamW on one rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sizes = bert_large_sizes()
    total = sum(sizes)
    padded = (total + world - 1) // world * world
    flat = torch.randn(padded, device=device)
    mine = flat[rank * (padded // world):(rank + 1) * (padded // world)]
    record("zero-all-reduce", lambda: dist.all_reduce(flat))
    record("zero-reduce-scatter", lambda: dist.reduce_scatter_tensor(mine, flat))
    record("zero-all-gather", lambda: dist.all_gather_into_tensor(flat, mine))
    del flat, mine
    torch.manual_seed(0)  # the same weights on every rank
    params = [torch.nn.Parameter(torch.randn(n, device=device) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    record("zero-fused-adamw", fused.step)
    del fused
    torch.cuda.empty_cache()
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4, fused=True)
    record("zero-step", zero.step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,16,256,1024", help="flat buffer sizes in MiB (f32)")
    parser.add_argument("--collectives", default="all-reduce,all-gather,reduce-scatter")
    parser.add_argument("--bert", default="on", choices=["on", "off"])
    parser.add_argument("--zero", default="off", choices=["on", "off"],
                        help="PyTorch's ZeRO path on BERT-large (gradkit-bench-sharded's torch rows)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--init-file", required=True, help="a path every rank can reach, not existing yet")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("torch not importable", file=sys.stderr)
        return 3

    rank = env_int("OMPI_COMM_WORLD_RANK", "RANK")
    world = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")
    local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", default=rank)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method="file://" + os.path.abspath(args.init_file), rank=rank,
                            world_size=world)

    def median_ms(fn):
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.reps):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return statistics.median(slowest.tolist())

    results = []

    def record(key, fn):
        try:
            ms = median_ms(fn)
            results.append((key, ms))
        except Exception as e:  # one failing case must not drop the others
            if rank == 0:
                print("%s failed: %s" % (key, e), file=sys.stderr)

    collectives = args.collectives.split(",")
    for collective in collectives:
        for mib in [int(x) for x in args.sizes.split(",")]:
            nbytes = mib << 20
            count = nbytes // 4
            shard = count // world
            buffer = torch.randn(count, device=device)
            mine = buffer[rank * shard:(rank + 1) * shard]
            key = "%s-%d" % (collective, nbytes)
            if collective == "all-reduce":
                record(key, lambda: dist.all_reduce(buffer))
            elif collective == "all-gather":
                output = buffer[:shard * world]
                record(key, lambda: dist.all_gather_into_tensor(output, mine))
            elif collective == "reduce-scatter":
                source = buffer[:shard * world]
                record(key, lambda: dist.reduce_scatter_tensor(mine, source))
            del buffer
            torch.cuda.empty_cache()

    if args.bert == "on":
        sizes = bert_large_sizes()
        flat = torch.randn(sum(sizes), device=device)
        record("bert-flat", lambda: dist.all_reduce(flat))
        del flat
        torch.cuda.empty_cache()
        tensors = [torch.randn(n, device=device) for n in sizes]  # separate allocations, as a model's grads

        def per_tensor():
            for t in tensors:
                dist.all_reduce(t)

        record("bert-coalesced", lambda: dist.all_reduce_coalesced(tensors))
        record("bert-per-tensor", per_tensor)

    if args.zero == "on":
        zero_rows(record, device, rank, world)

    if rank == 0:
        with open(args.out, "w") as f:
            for key, ms in results:
                f.write("%s %.6f\n" % (key, ms))
            f.write("# torch %s, NCCL %s, %d ranks\n" % (torch.__version__, ".".join(map(str, torch.cuda.nccl.version())),
                                                      world))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
