"""How the Python benchmarks time a call: the median over `reps` runs after
`warmup` untimed ones; CUDA events around each run on a GPU (the device time
of the work the call enqueued), the wall time on the CPU."""
import statistics
import time


def median_ms(fn, reps, warmup=3, cuda=True):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
