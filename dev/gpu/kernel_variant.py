#!/usr/bin/env python3
"""Builds a copy of libgradkit whose multi-tensor ops in some CUDA sources run
at other launch constants, beside an existing build: for comparing a kernel's
block size and register budget, or another of its constants
(dev/gpu/sweep-low-bit), in one run, without a build per choice.

The choice is THREADSxBLOCKS or "same", then optionally "@DIR", then any
number of ":NAME=VALUE". With @DIR, each source is read from DIR (a copy of
another revision's src/, as `git archive REV src`), so that the same run
can time the kernel as it was; DIR's headers come before the tree's (the
source's own directory and then the include path are searched), so that a
header the tree has since changed compiles as it was too.
With THREADSxBLOCKS, every `static constexpr int kMinBlocks = ...;` in the
given sources becomes `kMinBlocks = B; kBlockThreads = T;`
(cuda/multi_tensor.cuh reads both; any kBlockThreads the source sets is
dropped); "same" keeps them. Each NAME=VALUE sets every `static constexpr
int NAME = ...;` (or bool) to VALUE; each edit must change some source, and
a source none changes (without @DIR) keeps its object. Each edited source is compiled with
the build's own command (compile_commands.json) and the library relinked
with the build's link line, with the edited objects in place of the
originals; the build itself is left as it was. The variant is
BUILD/variants/NAME/<the library's file name>; ptxas's register and spill
report for each kernel is BUILD/variants/NAME/<source>.ptxas.

Usage: dev/gpu/kernel_variant.py BUILD NAME CHOICE SOURCE...
       (CHOICE as 256x3, same:kPrefetchAhead=1, 256x3:kChunkParts=2 or
       same@/tmp/head/src; SOURCE relative to src/, as cuda/adam_low_bit.cu)
"""
import json
import pathlib
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def edited(text, launch, constants):
    """The source with every op's launch constants (launch: (threads, blocks) or None)
    and the named constants set, and how many places each edit changed (it must
    change some)."""
    counts = []
    if launch is not None:
        threads, blocks = launch
        text = re.sub(r"static constexpr int kBlockThreads\s*=\s*[^;]+;", "", text)
        text, n = re.subn(r"static constexpr int kMinBlocks\s*=\s*[^;]+;",
                          f"static constexpr int kMinBlocks = {blocks}; static constexpr int kBlockThreads = {threads};",
                          text)
        counts.append(("kMinBlocks", n))
    for name, value in constants:
        text, n = re.subn(rf"static constexpr (int|bool) {name}\s*=\s*[^;]+;", rf"static constexpr \1 {name} = {value};",
                          text)
        counts.append((name, n))
    return text, counts


def parse_choice(choice):
    """((threads, blocks) or None, the sources' directory or None, [(name, value)]) of a CHOICE,
    or exits naming it."""
    first, *rest = choice.split(":")
    first, _, directory = first.partition("@")
    m = re.fullmatch(r"(\d+)x(\d+)", first)
    constants = [tuple(r.split("=", 1)) for r in rest]
    if (first != "same" and not m) or any(len(c) != 2 or not re.fullmatch(r"k\w+", c[0]) for c in constants):
        sys.exit(f"kernel_variant.py: the choice is '{choice}', expected THREADSxBLOCKS or 'same', then "
                 "optionally '@DIR', then ':kNAME=VALUE' any number of times (as 256x3, same:kPrefetchAhead=1 "
                 "or same@/tmp/head/src)")
    if directory and not pathlib.Path(directory).is_dir():
        sys.exit(f"kernel_variant.py: the choice '{choice}' reads its sources from {directory}, which is not a directory")
    return ((int(m.group(1)), int(m.group(2))) if m else None), directory or None, constants


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    build, name, sources = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[4:]
    launch, directory, constants = parse_choice(sys.argv[3])
    commands = build / "compile_commands.json"
    if not commands.exists():
        sys.exit(f"kernel_variant.py: {commands} is missing; configure with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON")
    entries = json.loads(commands.read_text())
    out = build / "variants" / name
    out.mkdir(parents=True, exist_ok=True)

    jobs = []  # (command, directory, ptxas log)
    objects = {}  # the build's object, relative to src/'s build directory -> the variant's
    changed = {}  # each edit -> the places it changed, over every source
    for source in sources:
        # The library's compile of the source (its -o names gradkit.dir), not a test's.
        entry = next((e for e in entries if e["file"].endswith("/src/" + source) and "gradkit.dir/" in e["command"]), None)
        if entry is None:
            sys.exit(f"kernel_variant.py: no compile command for src/{source} in {commands}")
        original = pathlib.Path(entry["file"]).read_text()
        base = (pathlib.Path(directory) / source).read_text() if directory else original
        text, counts = edited(base, launch, constants)
        for what, n in counts:
            changed[what] = changed.get(what, 0) + n
        if text == original and not directory:
            continue  # the build's object serves (with @DIR the headers may differ though the source does not)
        copy = out / pathlib.Path(source).name
        copy.write_text(text)
        obj = out / (copy.name + ".o")
        args = shlex.split(entry["command"])
        keep, skip = [], 0
        for a in args:  # drop the dependency file flags; point -o and the source at the copies
            if skip:
                skip -= 1
                continue
            if a in ("-MT", "-MF"):
                skip = 1
                continue
            if a == "-MD":
                continue
            keep.append(a)
        keep = [str(copy) if a == entry["file"] else a for a in keep]
        if directory:  # its headers before the tree's
            keep.insert(1, "-I" + str(pathlib.Path(directory).resolve()))
        output = keep[keep.index("-o") + 1]
        keep[keep.index("-o") + 1] = str(obj)
        keep += ["-Xptxas", "-v"]
        jobs.append((keep, entry["directory"], out / (copy.name + ".ptxas")))
        objects[output] = str(obj)

    unset = [what for what, n in changed.items() if n == 0]
    if unset:
        sys.exit(f"kernel_variant.py: no source of {' '.join(sources)} sets {', '.join(unset)}")

    def compile_one(job):
        args, directory, log = job
        with open(log, "w") as f:
            return subprocess.run(args, cwd=directory, stdout=f, stderr=subprocess.STDOUT).returncode

    if not jobs:
        sys.exit(f"kernel_variant.py: the choice '{sys.argv[3]}' changes no source; the build's library is the same")
    with ThreadPoolExecutor(len(jobs)) as pool:
        codes = list(pool.map(compile_one, jobs))
    for (args, _, log), code in zip(jobs, codes):
        if code != 0:
            sys.stderr.write(log.read_text()[-3000:])
            sys.exit(f"kernel_variant.py: compiling {args[-1]} failed")

    link_dir = build / "src"
    link = shlex.split((link_dir / "CMakeFiles" / "gradkit.dir" / "link.txt").read_text().splitlines()[0])
    library = link[link.index("-o") + 1]
    replaced = 0
    for i, a in enumerate(link):
        for original, variant in objects.items():
            if a == original or a.endswith("/" + original) or original.endswith("/" + a):
                link[i] = variant
                replaced += 1
    if replaced != len(objects):
        sys.exit(f"kernel_variant.py: found {replaced} of {len(objects)} objects in the link line")
    link[link.index("-o") + 1] = str(out / library)
    if subprocess.run(link, cwd=link_dir).returncode != 0:
        sys.exit("kernel_variant.py: linking failed")
    print(out / library)


if __name__ == "__main__":
    main()
