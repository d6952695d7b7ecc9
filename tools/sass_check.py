#!/usr/bin/env python3
"""Checks that a change leaves the machine code of every kernel instance as it was.

Each kernel instance is its own object file, CMakeFiles/jax_hopper_gemm.dir/instances/
gemm_<Kind>_<Type>_<MajorA>_<MajorB>_s<Stages>.cu.o. For every instance of the new
build this dumps ``cuobjdump --dump-sass`` and ``--dump-resource-usage``, normalizes
both (drops the /*address*/ column; replaces mangled ``_Z...`` symbols by placeholders
numbered in order of appearance, so renamed types and functions do not count; keeps
every instruction, operand, branch target, control/encoding word and resource line),
and compares them with the base build's dump of the same object file name.

Usage:
    # two build directories (configured with CMake and built, target jax_hopper_gemm)
    python3 tools/sass_check.py BASE_BUILD_DIR NEW_BUILD_DIR
    # or let the tool build a git revision's kernel library as the base, in a
    # temporary `git worktree` (cmake -G Ninja, Release, `ninja jax_hopper_gemm`)
    python3 tools/sass_check.py --base 0bd28eb NEW_BUILD_DIR

A new build is made the usual way, e.g.
    cmake -S . -B build/sass -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE=$(which python3)
    ninja -C build/sass -j2 jax_hopper_gemm
(with --base, ``--cmake-arg=-DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON`` passes an option on
to the base's configure step.)

It prints one row per instance: identical, DIFFERENT (with the start of a unified
diff), or present in only one build. The exit status is 1 if any instance of the new
build differs from the base or is missing from it, 0 otherwise. Instances only in the
base (for example kinds the new default build no longer compiles) are listed but are
no failure. Needs only the standard library and cuobjdump (from PATH, the CUDA
toolkit, or the nvidia-cuda-cuobjdump pip package).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

INSTANCE_DIR = pathlib.Path("CMakeFiles/jax_hopper_gemm.dir/instances")
_ADDRESS = re.compile(r"^(\s*)/\*[0-9a-f]{4,}\*/", re.MULTILINE)
_SYMBOL = re.compile(r"_Z[A-Za-z0-9_$.]+")


def find_cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = []
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidates.append(pathlib.Path(cuda_home) / "bin" / "cuobjdump")
    candidates.append(pathlib.Path("/usr/local/cuda/bin/cuobjdump"))
    try:
        import nvidia  # the nvidia-* pip packages' namespace

        for root in nvidia.__path__:
            candidates.extend(sorted(pathlib.Path(root).glob("*/bin/cuobjdump")))
    except ImportError:
        pass
    for cand in candidates:
        if cand.is_file():
            return str(cand)
    sys.exit("sass_check: cuobjdump not found (PATH, CUDA_HOME, or pip install nvidia-cuda-cuobjdump)")


def normalize(text: str) -> str:
    """Drops the address column and names mangled symbols by order of first appearance."""
    names: dict[str, str] = {}

    def placeholder(match: re.Match) -> str:
        return names.setdefault(match.group(0), f"<sym{len(names)}>")

    text = _ADDRESS.sub(r"\1", text)
    text = _SYMBOL.sub(placeholder, text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def dump(cuobjdump: str, obj: pathlib.Path) -> str:
    parts = []
    for flag in ("--dump-resource-usage", "--dump-sass"):
        result = subprocess.run([cuobjdump, flag, str(obj)], capture_output=True, text=True)
        if result.returncode != 0:
            return f"cuobjdump {flag} failed: {result.stderr.strip()}\n"
        parts.append(result.stdout)
    return normalize("".join(parts))


def instances(build: pathlib.Path) -> dict[str, pathlib.Path]:
    folder = build / INSTANCE_DIR
    if not folder.is_dir():
        sys.exit(f"sass_check: {folder} does not exist (configure and build target jax_hopper_gemm first)")
    return {p.name.removesuffix(".cu.o"): p for p in sorted(folder.glob("*.cu.o"))}


def dumps(cuobjdump: str, objects: dict[str, pathlib.Path]) -> dict[str, str]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(dump, cuobjdump, path) for name, path in objects.items()}
        return {name: future.result() for name, future in futures.items()}


def build_revision(rev: str, workdir: pathlib.Path, cmake_args: list[str], jobs: int) -> pathlib.Path:
    """Checks `rev` out into a worktree under `workdir` and builds its kernel library."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    source = workdir / "src"
    build = workdir / "build"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(source), rev], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}", *cmake_args], check=True, stdout=subprocess.DEVNULL)
    start = time.monotonic()
    subprocess.run(["ninja", "-C", str(build), f"-j{jobs}", "jax_hopper_gemm"], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"sass_check: built {rev} (target jax_hopper_gemm, -j{jobs}) in {time.monotonic() - start:.0f} s")
    return build


def remove_worktree(workdir: pathlib.Path) -> None:
    repo = pathlib.Path(__file__).resolve().parent.parent
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(workdir / "src")],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def compare(base: pathlib.Path, new: pathlib.Path, context: int) -> int:
    cuobjdump = find_cuobjdump()
    base_objects, new_objects = instances(base), instances(new)
    base_dumps = dumps(cuobjdump, base_objects)
    new_dumps = dumps(cuobjdump, new_objects)
    width = max(map(len, base_objects.keys() | new_objects.keys()), default=10)
    failures = identical = 0
    for name in sorted(base_objects.keys() | new_objects.keys()):
        if name not in new_dumps:
            print(f"{name:<{width}}  only in the base build")
            continue
        if name not in base_dumps:
            print(f"{name:<{width}}  MISSING from the base build")
            failures += 1
            continue
        if base_dumps[name] == new_dumps[name]:
            print(f"{name:<{width}}  identical")
            identical += 1
            continue
        failures += 1
        diff = list(difflib.unified_diff(base_dumps[name].splitlines(), new_dumps[name].splitlines(), "base", "new",
                                         n=1, lineterm=""))
        changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        print(f"{name:<{width}}  DIFFERENT ({changed} changed lines)")
        for line in diff[:context]:
            print(f"    {line}")
        if len(diff) > context:
            print(f"    ... {len(diff) - context} more diff lines")
    print(f"sass_check: {identical} of {len(new_objects)} instances of the new build identical, {failures} failing")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="BUILD_DIR", help="BASE_BUILD_DIR NEW_BUILD_DIR, or NEW_BUILD_DIR "
                        "with --base")
    parser.add_argument("--base", metavar="REV", help="build this git revision as the base")
    parser.add_argument("--cmake-arg", action="append", default=[], help="extra configure argument for --base")
    parser.add_argument("--jobs", type=int, default=2, help="ninja jobs for --base (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep --base's worktree and build (path printed)")
    parser.add_argument("--context", type=int, default=24, help="diff lines shown per differing instance")
    args = parser.parse_args(argv)
    if args.base is None:
        if len(args.dirs) != 2:
            parser.error("give BASE_BUILD_DIR NEW_BUILD_DIR, or --base REV NEW_BUILD_DIR")
        return compare(pathlib.Path(args.dirs[0]), pathlib.Path(args.dirs[1]), args.context)
    if len(args.dirs) != 1:
        parser.error("with --base, give only NEW_BUILD_DIR")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="sass_check."))
    try:
        base = build_revision(args.base, workdir, args.cmake_arg, args.jobs)
        return compare(base, pathlib.Path(args.dirs[0]), args.context)
    finally:
        if args.keep:
            print(f"sass_check: base kept in {workdir}")
        else:
            remove_worktree(workdir)
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
