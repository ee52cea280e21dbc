#!/usr/bin/env python3
"""Builds a copy of libgradkit whose multi-tensor ops in some CUDA sources run
at other tuning values, beside an existing build: for comparing a kernel's
block size and register budget, or another of its knobs
(dev/gpu/sweep-low-bit), in one run, without a build per choice.

A source's knobs are the macros of the tuning tables it includes
(`#include "cuda/..._tuning.cuh"`: cuda/adam_low_bit_tuning.cuh,
cuda/lamb_low_bit_tuning.cuh), each a default a compile definition
overrides (GRADKIT_ADAM_INT8_MIN_BLOCKS, GRADKIT_LAMB_LOW_BIT_NORMS_PREFETCH_AHEAD,
...; each table's top comment names them). A variant is the sources compiled
with the build's own command (compile_commands.json) plus -D definitions of
those macros; no source is edited.

The choice is THREADSxBLOCKS or "same", then optionally "@DIR", then any
number of ":NAME=VALUE". With THREADSxBLOCKS, every *_BLOCK_THREADS macro of
the given sources' tables is THREADS and every *_MIN_BLOCKS macro BLOCKS
(cuda/multi_tensor.cuh reads both from each op); "same" keeps them. Each
NAME=VALUE defines every macro NAME matches to VALUE: NAME is a macro's name,
with or without its GRADKIT_ prefix, and may hold the wildcards * and ?
(ADAM_INT8_MIN_BLOCKS=4, "ADAM_INT8*_STAGE=false", "*_PREFETCH_AHEAD=1");
later settings override earlier ones (256x3:LAMB_LOW_BIT_UPDATE_MIN_BLOCKS=5).
Each setting must match some macro of the given sources' tables, and a source
none sets (without @DIR) keeps its object. With @DIR, each source is read from
DIR (a copy of another revision's src/, as `git archive REV src`), so that the
same run can time the kernel as it was; DIR's headers, its tables among them,
come before the tree's (the source's own directory and then the include path
are searched), so that a header the tree has since changed compiles as it was
too. The library is relinked with the build's link line, with the variant's
objects in place of the originals; the build itself is left as it was. The
variant is BUILD/variants/NAME/<the library's file name>; for each source,
ptxas's register and spill report for each kernel is
BUILD/variants/NAME/<source>.ptxas and the definitions it was compiled with
BUILD/variants/NAME/<source>.defines.

Usage: dev/gpu/kernel_variant.py BUILD NAME CHOICE SOURCE...
       (CHOICE as 256x3, same:ADAM_INT4_PREFETCH_AHEAD=1, 256x3:ADAM_INT8_CHUNK_PARTS=1
       or same@/tmp/head/src; SOURCE relative to src/, as cuda/adam_low_bit.cu)
"""
import fnmatch
import json
import pathlib
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def tunables(text, include_dirs):
    """The macros of the tuning tables a source's text includes, in the order they
    are defined, each table found in the first of include_dirs that holds it."""
    names = []
    for header in re.findall(r'^\s*#\s*include\s+"([\w/]+_tuning\.cuh)"', text, re.M):
        path = next((d / header for d in include_dirs if (d / header).is_file()), None)
        if path is None:
            sys.exit(f"kernel_variant.py: the tuning table {header} is not under {', '.join(map(str, include_dirs))}")
        names += re.findall(r"^\s*#\s*ifndef\s+(GRADKIT_\w+)\s*$", path.read_text(), re.M)
    return names


def definitions(names, launch, settings):
    """{macro: value} of one source's tunables (names) for a choice, and the
    settings ("THREADSxBLOCKS" or NAME) that matched some of them."""
    chosen, matched = {}, set()
    if launch is not None:
        threads, blocks = launch
        for n in names:
            if n.endswith("_BLOCK_THREADS"):
                chosen[n] = str(threads)
            elif n.endswith("_MIN_BLOCKS"):
                chosen[n] = str(blocks)
        if chosen:
            matched.add("THREADSxBLOCKS")
    for pattern, value in settings:
        full = pattern if pattern.startswith("GRADKIT_") else "GRADKIT_" + pattern
        hits = [n for n in names if fnmatch.fnmatchcase(n, full)]
        for n in hits:
            chosen[n] = value
        if hits:
            matched.add(pattern)
    return chosen, matched


def parse_choice(choice):
    """((threads, blocks) or None, the sources' directory or None, [(name, value)]) of a CHOICE,
    or exits naming it."""
    first, *rest = choice.split(":")
    first, _, directory = first.partition("@")
    m = re.fullmatch(r"(\d+)x(\d+)", first)
    settings = [tuple(r.split("=", 1)) for r in rest]
    if (first != "same" and not m) or any(
            len(s) != 2 or not re.fullmatch(r"[A-Za-z0-9_*?]+", s[0]) or not re.fullmatch(r"[\w.+-]+", s[1])
            for s in settings):
        sys.exit(f"kernel_variant.py: the choice is '{choice}', expected THREADSxBLOCKS or 'same', then "
                 "optionally '@DIR', then ':NAME=VALUE' any number of times, NAME a tuning macro's name or a "
                 "pattern of them (as 256x3, same:ADAM_INT4_PREFETCH_AHEAD=1, 'same:ADAM_INT8*_STAGE=false' "
                 "or same@/tmp/head/src)")
    if directory and not pathlib.Path(directory).is_dir():
        sys.exit(f"kernel_variant.py: the choice '{choice}' reads its sources from {directory}, which is not a directory")
    return ((int(m.group(1)), int(m.group(2))) if m else None), directory or None, settings


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    build, name, sources = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[4:]
    launch, directory, settings = parse_choice(sys.argv[3])
    commands = build / "compile_commands.json"
    if not commands.exists():
        sys.exit(f"kernel_variant.py: {commands} is missing; configure with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON")
    entries = json.loads(commands.read_text())
    out = build / "variants" / name
    out.mkdir(parents=True, exist_ok=True)

    jobs = []  # (command, directory, ptxas log)
    objects = {}  # the build's object, relative to src/'s build directory -> the variant's
    matched = set()  # the settings that matched some source's tunables
    known = []  # every tunable of the sources, for the error below
    for source in sources:
        # The library's compile of the source (its -o names gradkit.dir), not a test's.
        entry = next((e for e in entries if e["file"].endswith("/src/" + source) and "gradkit.dir/" in e["command"]), None)
        if entry is None:
            sys.exit(f"kernel_variant.py: no compile command for src/{source} in {commands}")
        tree_src = pathlib.Path(entry["file"][: -len(source)])  # the tree's src/
        path = pathlib.Path(directory).resolve() / source if directory else pathlib.Path(entry["file"])
        include_dirs = ([pathlib.Path(directory).resolve()] if directory else []) + [tree_src]
        names = tunables(path.read_text(), include_dirs)
        known += names
        chosen, hits = definitions(names, launch, settings)
        matched |= hits
        if not chosen and not directory:
            continue  # the build's object serves (with @DIR the sources may differ though no definition does)
        stem = pathlib.Path(source).name
        obj = out / (stem + ".o")
        (out / (stem + ".defines")).write_text("".join(f"{k}={v}\n" for k, v in chosen.items()))
        args = shlex.split(entry["command"])
        keep, skip = [], 0
        for a in args:  # drop the dependency file flags; point -o (and with @DIR the source) at the variant's
            if skip:
                skip -= 1
                continue
            if a in ("-MT", "-MF"):
                skip = 1
                continue
            if a == "-MD":
                continue
            keep.append(a)
        keep = [str(path) if a == entry["file"] else a for a in keep]
        if directory:  # its headers before the tree's
            keep.insert(1, "-I" + str(pathlib.Path(directory).resolve()))
        output = keep[keep.index("-o") + 1]
        keep[keep.index("-o") + 1] = str(obj)
        keep += [f"-D{k}={v}" for k, v in chosen.items()]  # after the build's own, so that they win
        keep += ["-Xptxas", "-v"]
        jobs.append((keep, entry["directory"], out / (stem + ".ptxas")))
        objects[output] = str(obj)

    asked = (["THREADSxBLOCKS"] if launch is not None else []) + [p for p, _ in settings]
    unset = [p for p in asked if p not in matched]
    if unset:
        sys.exit(f"kernel_variant.py: no tuning macro of {' '.join(sources)} matches {', '.join(unset)}; "
                 f"theirs: {' '.join(n[len('GRADKIT_'):] for n in known) or 'none (no tuning table included)'}")

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
            sys.exit(f"kernel_variant.py: compiling {log.name[: -len('.ptxas')]} failed")

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
