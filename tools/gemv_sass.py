"""Where a GEMV kernel issues its loads: registers, spills and the load/MMA order of its SASS.

`asm volatile` fixes the order of a round's loads in the PTX, not in ptxas's schedule: short of
registers, ptxas may move loads below the first MMA, which waits for the earlier ones, so the
round costs two trips to memory instead of one. This script compiles kernels as the executor
does (`ep.device.compile_kernel`: this machine's NVRTC, each kernel's own options and target,
no cache), prints their registers, stack and local (spill) bytes as ``cuobjdump`` reports them,
disassembles them with ``nvdisasm`` and prints, per kernel, one letter per instruction of
interest from the FULL path's first round on: ``L`` a weight load (``.NA``: no L1 allocation),
``X`` another load (x), ``S`` a spill (a local load or store), ``H`` an MMA (``G`` a
warpgroup MMA), ``W`` the PDL wait, ``|`` a branch, ``E`` an exit. In a healthy round every
``L`` and ``X`` comes before the round's first ``H`` (``...|LLLXXXXXLXXXHH|HH|HHHH|`` at 4
steps a round, 16 rows).

    python3 tools/gemv_sass.py                          # the dense fp16/bf16 decode GEMVs
    python3 tools/gemv_sass.py ep_gemv_nk16_swiglu_bf16 ep_gemv_nk_rope_bf16
    python3 tools/gemv_sass.py ep_gemv_q4f8_bf16 --width 400   # any registered kernel, from its
                                                               # start when it has no FULL path

Needs ``nvdisasm`` and ``cuobjdump`` (the CUDA toolkit, or the ``nvidia-cuda-nvdisasm`` and
``nvidia-cuda-cuobjdump`` wheels): ``--nvdisasm`` / ``--cuobjdump`` (default: beside nvdisasm),
else ``$PATH``, else ``/usr/local/cuda*/bin``. No GPU needed. Schedules change with the NVRTC
version: run it from a Python with the device machine's NVRTC (13.0 on the H200:
``pip install nvidia-cuda-nvrtc==13.0.88 cuda-bindings==13.3.1`` in a venv) to see that
machine's SASS.
"""

from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ep.cli import register_all_kernels  # noqa: E402
from ep.device import KERNELS  # noqa: E402
from ep.device import compile_kernel as device_compile  # noqa: E402
from ep.device._kernels import nvrtc_version  # noqa: E402

DEFAULT = [
    f"ep_gemv_{family}_{dt}"
    for dt in ("bf16", "f16")
    for family in ("nk", "nk_swiglu", "nk_rope", "nk16", "nk16_swiglu", "nk16_rope")
]
ARCH = "sm_90"  # the H200's


def find_tool(name: str, given: str | None) -> str:
    """``name`` (nvdisasm, cuobjdump): ``given``, else ``$PATH``, else ``/usr/local/cuda*/bin``."""
    found = given or shutil.which(name)
    if not found:
        found = next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))), None)
    if not found or not Path(found).exists():
        raise SystemExit(
            f"{name} not found: install the CUDA toolkit or the nvidia-cuda-{name} wheel, or "
            f"pass --{name} PATH"
        )
    return found


def compile_kernel(name: str, arch: str = ARCH) -> tuple[str, bytes]:
    """``name``'s cubin as the executor compiles it for ``arch`` (its options and target, e.g.
    sm_90a for the wgmma kernels; no cache), and that target."""
    register_all_kernels()
    if name not in KERNELS:
        raise SystemExit(f"no kernel named {name!r}; registered: {', '.join(KERNELS.names())}")
    compiled = device_compile(KERNELS.get(name), arch, use_cache=False)
    return compiled.arch, compiled.cubin


def resources(cuobjdump: str, cubin: Path) -> str:
    """Registers, stack and local (spill) bytes of the cubin's kernel, as cuobjdump reports them."""
    text = subprocess.run(
        [cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) .*?LOCAL:(\d+)", text)
    if not m:
        return "resources: not reported"
    return f"registers {m.group(1):>3s}  stack {m.group(2)} B  local {m.group(3)} B"


def order(sass: str, width: int) -> str:
    """The load/MMA letters (module docstring) from the FULL path's first round on."""
    letters = []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]+\*/\s+(.*?);", line)
        if not m:
            continue
        ins = m.group(1)
        if "LDG" in ins:
            letters.append("L" if ".NA" in ins else "X")
        elif "LDL" in ins or "STL" in ins:
            letters.append("S")
        elif "HMMA" in ins:
            letters.append("H")
        elif "GMMA" in ins:
            letters.append("G")
        elif "BRA" in ins:
            letters.append("|")
        elif "ACQBULK" in ins:
            letters.append("W")
        elif "EXIT" in ins:
            letters.append("E")
    seq = "".join(letters)
    start = max(seq.find("W|LLLL"), 0)  # row_gemv's FULL path: the weights before the PDL wait
    return seq[start : start + width]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "kernels", nargs="*", default=DEFAULT, help="kernel names (default: %(default)s)"
    )
    p.add_argument("--arch", default=ARCH, help="the device's architecture (default %(default)s)")
    p.add_argument("--nvdisasm", help="the nvdisasm binary")
    p.add_argument("--cuobjdump", help="the cuobjdump binary (registers, stack, local bytes)")
    p.add_argument("--width", type=int, default=90, help="letters printed a kernel")
    args = p.parse_args(argv)
    nvdisasm = find_tool("nvdisasm", args.nvdisasm)
    cuobjdump = find_tool("cuobjdump", args.cuobjdump or str(Path(nvdisasm).with_name("cuobjdump")))
    print(f"NVRTC {nvrtc_version()}, {args.arch}, {nvdisasm}")
    for name in args.kernels:
        target, cubin = compile_kernel(name, args.arch)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{name}.cubin"
            path.write_bytes(cubin)
            sass = subprocess.run(
                [nvdisasm, "-c", str(path)], capture_output=True, text=True, check=True
            ).stdout
            usage = resources(cuobjdump, path)
        print(f"{name:28s} {target:7s} {usage}")
        print(f"    {order(sass, args.width)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
