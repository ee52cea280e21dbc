#!/usr/bin/env bash
# End to end: `gradkit train` on 2 ranks (it starts mpiexec itself), one short
# run on a subset; the loss must fall and the accuracy be far above chance.
set -euo pipefail
gradkit=$1
if [[ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]]; then
  echo "dataset-fashion-mnist is not installed (scripts/setup installs it): skipped"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$gradkit" train --ranks 2 --epochs 2 --limit 12000 --progress off --log log.csv --save run.ckpt | tee out.txt
python3 - <<'PY'
import csv
rows = list(csv.DictReader(open("log.csv")))
assert len(rows) == 2, rows
loss = [float(r["train_loss"]) for r in rows]
accuracy = [float(r["test_accuracy"]) for r in rows]
assert loss[1] < loss[0], f"loss did not fall: {loss}"
assert accuracy[-1] > 0.7, f"accuracy {accuracy[-1]} is not far above chance (0.1)"
print(f"e2e: loss {loss[0]:.4f} -> {loss[1]:.4f}, test accuracy {accuracy[-1]:.4f}")
PY
test -s run.ckpt
# The sharded step (ZeRO stage 2, the optimizer state split over the 2
# ranks) trains the same model: with 2 ranks a reduce-scatter adds the same
# two numbers as the all-reduce, so the losses and accuracies are the same.
"$gradkit" train --ranks 2 --epochs 2 --limit 12000 --progress off --log sharded.csv --shard 2 | tee sharded.txt
grep -q "sharded (ZeRO stage 2" sharded.txt
python3 - <<'PY'
import csv
plain = [(r["train_loss"], r["test_accuracy"]) for r in csv.DictReader(open("log.csv"))]
sharded = [(r["train_loss"], r["test_accuracy"]) for r in csv.DictReader(open("sharded.csv"))]
assert plain == sharded, f"sharded {sharded} != unsharded {plain}"
print(f"e2e: --shard 2 gives the unsharded losses and accuracies {plain}")
PY
# A bad argument is an error that names it, before anything runs.
if "$gradkit" train --ranks 1 --epochs 0 2> err.txt; then echo "accepted --epochs 0"; exit 1; fi
grep -q -- "--epochs: expected an integer" err.txt
# A missing dataset directory is a clear error.
if "$gradkit" train --ranks 1 --data "$work/nowhere" --progress off 2> err.txt; then echo "accepted a missing dataset"; exit 1; fi
grep -q "cannot be opened" err.txt
echo "e2e: passed"
