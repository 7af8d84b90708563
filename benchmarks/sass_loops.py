"""What ptxas made of a kernel's loops, on any machine (no GPU): NVRTC compiles ``hybrid_runtime/ops/cuda/<file>``
with the given -D options for an arch, nvdisasm (the ``nvidia-cuda-nvdisasm`` dev dependency) disassembles the
cubin, and each loop of the chosen kernels (a backward branch and the instructions it jumps back over) is listed
with its instruction count and mix::

    python -m benchmarks.sass_loops moe_nbits_decode.cu moe_nb_gate_up -D DT=2 -D MN_BITS=4 -D MN_REG=1 \\
        -D MD_GU_STAGES=8 -D MD_DN_STAGES=5

An issue-bound kernel (ncu: warps mostly eligible, few cycles per issued instruction) runs as fast as its hot
loop's instruction count allows: this is the count to cut, measured before any device time is spent. The counts
are static: predicated-off instructions are counted (they issue all the same); inner loops are listed on their own
and again inside the loops that contain them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRA = re.compile(r"\bBRA\b.*?\(?\.(L_x_\d+)\)?")


def nvdisasm_path() -> str | None:
    """nvdisasm: $NVDISASM, then PATH, then the nvidia-cuda-nvdisasm wheel (nvidia/cu13/bin), then a CUDA toolkit
    in /usr/local/cuda; None when there is none."""
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if found:
        return found
    roots = []
    try:
        import nvidia

        roots += [Path(p) / "cu13" / "bin" for p in nvidia.__path__]
    except ImportError:
        pass
    roots.append(Path("/usr/local/cuda/bin"))
    for root in roots:
        if (root / "nvdisasm").is_file():
            return str(root / "nvdisasm")
    return None


@dataclass(frozen=True)
class Loop:
    """Instructions ``first`` .. ``last`` (indices into the kernel's instruction list) of one loop: ``label`` is
    the branch target at ``first``, ``mix`` the opcodes (without modifiers or predicates) and their counts."""

    label: str
    first: int
    last: int
    mix: Counter

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def opcode(text: str) -> str:
    """The opcode of one SASS instruction without its predicate guard or modifiers: ``@!P0 HMMA.16816.F32 ...`` ->
    ``HMMA``."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def kernels(sass: str) -> dict[str, list[str]]:
    """nvdisasm output -> kernel name -> its instructions in order, with branch labels as ``.L_x_N`` entries."""
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in sass.splitlines():
        m = re.match(r"\s*\.text\.(\w+):", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        if mi := _INS.match(line):
            cur.append(mi.group(2))
        elif ml := _LABEL.match(line):
            cur.append("." + ml.group(1))
    return out


def loops(ins: list[str]) -> list[Loop]:
    """Every backward branch of one kernel's instruction list (as :func:`kernels` gives it) as a :class:`Loop`:
    from its target label to the branch, labels not counted. Outer loops include their inner loops."""
    at: dict[str, int] = {}
    found = []
    for i, text in enumerate(ins):
        if text.startswith(".L_x_"):
            at[text[1:]] = i
            continue
        m = _BRA.search(text)
        if m and opcode(text) == "BRA" and m.group(1) in at and at[m.group(1)] < i:
            body = [t for t in ins[at[m.group(1)]:i + 1] if not t.startswith(".L_x_")]
            found.append(Loop(m.group(1), at[m.group(1)], i, Counter(opcode(t) for t in body)))
    return found


def disassemble(file: str, defines: list[str], arch: str) -> str:
    """NVRTC cubin of ``hybrid_runtime/ops/cuda/<file>`` with ``-D<define>`` options for ``arch``, disassembled."""
    from hybrid_runtime.cuda.kernels import compile_cubin, source

    tool = nvdisasm_path()
    if tool is None:
        raise SystemExit("nvdisasm not found: set NVDISASM or install the nvidia-cuda-nvdisasm dev dependency")
    cubin = compile_cubin(source(file), file, tuple(f"-D{d}" for d in defines), arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout


def report(sass: str, names: list[str], top: int = 12) -> list[str]:
    """Lines: per kernel of ``names`` (all when empty) its instruction count, then each loop's size and mix."""
    lines = []
    for name, ins in kernels(sass).items():
        if names and name not in names:
            continue
        n = sum(not t.startswith(".L_x_") for t in ins)
        lines.append(f"{name}: {n} instructions")
        for lp in sorted(loops(ins), key=lambda lp: lp.first):
            mix = ", ".join(f"{k} {v}" for k, v in lp.mix.most_common(top))
            lines.append(f"  loop {lp.label} [{lp.first}..{lp.last}]: {sum(lp.mix.values())} instructions; {mix}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a source of hybrid_runtime/ops/cuda (e.g. moe_decode.cu)")
    ap.add_argument("kernels", nargs="*", help="kernel names (default: every kernel of the module)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, as -D for NVRTC")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = ap.parse_args()
    for line in report(disassemble(args.file, args.defines, args.arch), args.kernels, args.top):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
