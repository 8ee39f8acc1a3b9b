"""Where a GEMV kernel issues its loads: registers, spills and the load/MMA order of its SASS.

`asm volatile` fixes the order of a round's loads in the PTX, not in ptxas's schedule: short of
registers, ptxas may move loads below the first MMA, which waits for the earlier ones, so the
round costs two trips to memory instead of one. This script compiles kernels with this
machine's NVRTC (the one the executor would use), disassembles them with ``nvdisasm`` and
prints, per kernel, one letter per instruction of interest from the FULL path's first round on:
``L`` a weight load (``.NA``: no L1 allocation), ``X`` another load (x), ``H`` an MMA (``G`` a
warpgroup MMA), ``W`` the PDL wait, ``|`` a branch, ``E`` an exit. In a healthy round every
``L`` and ``X`` comes before the round's first ``H`` (``...|LLLXXXXXLXXXHH|HH|HHHH|`` at 4 steps
a round, 16 rows).

    python3 tools/gemv_sass.py                          # the dense fp16/bf16 decode GEMVs
    python3 tools/gemv_sass.py ep_gemv_nk16_swiglu_bf16 ep_gemv_nk_rope_bf16
    python3 tools/gemv_sass.py ep_gemv_q4f8_bf16 --width 400   # any registered kernel, from its
                                                               # start when it has no FULL path

Needs ``nvdisasm`` (the CUDA toolkit, or the ``nvidia-cuda-nvdisasm`` wheel): ``--nvdisasm``,
else ``$PATH``, else ``/usr/local/cuda*/bin``. No GPU needed.
"""

from __future__ import annotations

import argparse
import glob
import io
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
from ep.device._kernels import compiled_source, cuda_headers, nvrtc_version  # noqa: E402

DEFAULT = [
    f"ep_gemv_{family}_{dt}"
    for dt in ("bf16", "f16")
    for family in ("nk", "nk_swiglu", "nk_rope", "nk16", "nk16_swiglu", "nk16_rope")
]
ARCH = "sm_90a"


def find_nvdisasm(given: str | None) -> str:
    found = given or shutil.which("nvdisasm")
    if not found:
        found = next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvdisasm"))), None)
    if not found or not Path(found).exists():
        raise SystemExit(
            "nvdisasm not found: install the CUDA toolkit or the nvidia-cuda-nvdisasm wheel, or "
            "pass --nvdisasm PATH"
        )
    return found


def compile_kernel(name: str) -> tuple[str, str, bytes]:
    """``name``'s cubin for ARCH, and ptxas's register and spill lines."""
    from cuda.core import Program, ProgramOptions

    register_all_kernels()
    if name not in KERNELS:
        raise SystemExit(f"no kernel named {name!r}; registered: {', '.join(KERNELS.names())}")
    opts = ProgramOptions(
        arch=ARCH, std="c++17", include_path=[cuda_headers()[0]], ptxas_options=["-v"]
    )
    logs = io.StringIO()
    code = Program(compiled_source(KERNELS.get(name), ARCH), "c++", opts).compile(
        "cubin", logs=logs
    )
    text = logs.getvalue()
    regs = ",".join(re.findall(r"Used (\d+) registers", text))
    spills = ",".join(re.findall(r"(\d+) bytes spill stores", text))
    return regs, spills, bytes(code.code)


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
    p.add_argument("--nvdisasm", help="the nvdisasm binary")
    p.add_argument("--width", type=int, default=90, help="letters printed a kernel")
    args = p.parse_args(argv)
    nvdisasm = find_nvdisasm(args.nvdisasm)
    print(f"NVRTC {nvrtc_version()}, {ARCH}, {nvdisasm}")
    for name in args.kernels:
        regs, spills, cubin = compile_kernel(name)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run(
                [nvdisasm, "-c", f.name], capture_output=True, text=True, check=True
            ).stdout
        print(f"{name:28s} registers {regs:>4s}  spill stores {spills} bytes")
        print(f"    {order(sass, args.width)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
