"""The decode kernel compiled for an H200 (sm_90) on a CPU machine: what Triton and ptxas make of each config.

Per config: registers per thread, shared memory, how many programs fit on one SM, and the instructions of the inner
loop (one K/V tile per iteration, per thread) by kind, read from the SASS that Triton's bundled nvdisasm prints.
No GPU needed: Triton lowers to PTX in process and its bundled ptxas assembles for sm_90.

    python benchmarks/compile_report.py                # bf16 default + the fp8 sweep's grid (kernels.py --fp8-sweep)
    python benchmarks/compile_report.py --default-only # bf16, fp8 and fp8_via_f16 at the default config

The shape is the sweep's: Qwen3-0.6B heads (16 q / 8 KV, head_dim 128), block size 16, bf16 queries, one split
(256 sequences fill the GPU), integer arguments divisible by 16 as Triton specialises them there. The numbers are
those of the installed Triton: run it with the GPU machine's version (3.6.0 so far, e.g. `pip install --target DIR
triton==3.6.0` and PYTHONPATH=DIR) to read the kernels that machine runs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]
from kernels import fp8_sweep_configs  # noqa: E402

# One sm_90 SM: 64K 32-bit registers (allocated per warp in units of 256), 64 warps, 228 KB of shared memory of
# which a program may take 227 KB; the driver reserves 1 KB per program.
SM_REGISTERS, SM_WARPS, SM_SHARED, SHARED_RESERVED = 65536, 64, 228 * 1024, 1024
SHAPE = dict(GROUP=2, ROWS=16, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, NUM_SPLITS=1, STORE_LSE=False)
DEFAULT = dict(block_n=64, num_warps=4, num_stages=3)
KINDS = {  # opcode (before the first dot) -> kind; the rest is "other"
    "convert": ("F2F", "F2FP", "I2F", "F2I", "HADD2"),
    "shared load": ("LDS", "LDSM"),
    "global to shared": ("LDGSTS",),
    "mma": ("HMMA", "HGMMA", "QGMMA"),
    "integer": ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "SEL", "VIADD", "PRMT", "P2R", "R2P", "PLOP3", "SGXT"),
}


def decode_source(fp8: bool, block_n: int, fp8_via_f16: bool):
    """The split kernel's source with the signature and constants the launcher gives it for SHAPE."""
    from triton.compiler import ASTSource

    kernel = importlib.import_module("pagedllm.kernels.decode_attention")._decode_split_kernel
    cache = "fp8e4nv" if fp8 else "bf16"
    # With one split the launcher passes the output (bf16) as partial_out and partial_lse; without fp8 the caches
    # stand in for the scales.
    pointers = dict(query_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache, k_scale_ptr="fp32" if fp8 else cache,
                    v_scale_ptr="fp32" if fp8 else cache, partial_out_ptr="bf16", partial_lse_ptr="bf16",
                    seq_lens_ptr="i32", block_tables_ptr="i32")  # fmt: skip
    constants = dict(SHAPE, BLOCK_N=block_n, FP8=fp8, FP8_VIA_F16=fp8_via_f16)
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:  # pointers (16-byte aligned) and integers (all divisible by 16 at SHAPE)
            signature[name] = "*" + pointers[name] if name in pointers else "i32"
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constants, attrs)


def compile_sm90(source, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget

    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def nvidia_tool(name: str, *args: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def loop_instructions(sass: str) -> collections.Counter:
    """Opcodes (predicates dropped, modifiers kept) of the longest loop: from a label to the last branch back to it."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        instruction = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", line)
        if instruction:
            instructions.append((instruction.group(1), instruction.group(2)))
    longest = (0, 0)
    for end, (opcode, operands) in enumerate(instructions):
        target = re.search(r"(\.L_x_\d+)", operands)
        if opcode == "BRA" and target and labels.get(target.group(1), end + 1) <= end:
            start = labels[target.group(1)]
            longest = max(longest, (start, end + 1), key=lambda span: span[1] - span[0])
    return collections.Counter(opcode for opcode, _ in instructions[longest[0] : longest[1]])


def kind_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    return next((kind for kind, bases in KINDS.items() if base in bases), "other")


def programs_per_sm(registers: int, shared: int, num_warps: int) -> int:
    registers_per_warp = -(-registers * 32 // 256) * 256
    return min(SM_WARPS // num_warps, SM_REGISTERS // (registers_per_warp * num_warps),
               SM_SHARED // (shared + SHARED_RESERVED))  # fmt: skip


def report(cache: str, config: dict) -> dict:
    """One row: the compiler's resources and loop instructions for cache "bf16" or "fp8" at config."""
    fp8_via_f16 = config.get("fp8_via_f16", False)
    row = {"cache": cache, **DEFAULT, **config}
    start = time.perf_counter()
    try:
        source = decode_source(cache == "fp8", row["block_n"], fp8_via_f16)
        compiled = compile_sm90(source, row["num_warps"], row["num_stages"])
    except Exception as error:  # out of shared memory, for one
        return {**row, "error": repr(error)[:200]}
    row["compile_s"] = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = nvidia_tool("cuobjdump", "-res-usage", cubin.name)
        sass = nvidia_tool("nvdisasm", "-c", cubin.name)
    row["registers"] = int(re.search(r"REG:(\d+)", usage).group(1))
    row["spills"] = int(re.search(r"LOCAL:(\d+)", usage).group(1))  # bytes of local memory per thread
    row["shared"] = compiled.metadata.shared
    row["programs_per_sm"] = programs_per_sm(row["registers"], row["shared"], row["num_warps"])
    loop = loop_instructions(sass)
    row["loop"] = sum(loop.values())
    # Warp-instructions per 64 keys per program: rows of other BLOCK_N and num_warps compare on the same work.
    row["per_64_keys"] = round(row["loop"] * row["num_warps"] * 64 / row["block_n"])
    row["LDS.U8"] = loop["LDS.U8"]
    kinds = collections.Counter()
    for opcode, count in loop.items():
        kinds[kind_of(opcode)] += count
    row.update(kinds)
    row["top"] = ", ".join(f"{opcode} {count}" for opcode, count in loop.most_common(6))
    return row


COLUMNS = ("cache", "block_n", "num_warps", "num_stages", "fp8_via_f16", "registers", "spills",
           "shared", "programs_per_sm", "loop", "per_64_keys", *KINDS, "LDS.U8", "other", "compile_s", "top",
           "error")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default-only", action="store_true", help="bf16, fp8, fp8_via_f16 at the default config")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    import triton

    print(f"Triton {triton.__version__}, sm_90, decode kernel; loop = instructions per thread per K/V tile")
    rows = [("bf16", {})]
    if args.default_only:
        rows += [("fp8", {}), ("fp8", {"fp8_via_f16": True})]
    else:
        rows += [("fp8", config) for config in fp8_sweep_configs()]
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    results = []
    for cache, config in rows:
        row = report(cache, config)
        results.append(row)
        cells = [row.get(column, "") for column in COLUMNS]
        print("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
