"""The Triton kernel compiles for a real GPU target (sm_90) and moves 16-byte vectors.

The interpreter runs the kernel's semantics but is lenient about what the GPU compiler accepts,
and says nothing about vector widths, which decide whether a copy reaches memory bandwidth. The
compile needs no GPU; it runs in a child process because TRITON_INTERPRET=1 (set for the other
tests) turns @triton.jit functions into interpreted ones.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COMPILE_FOR_SM90 = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rl3d._kernels.triton.strided_copy import strided_copy_kernel

ints = ["num_rows", "num_cols", "src_batch_stride", "src_row_stride", "src_col_stride",
        "dst_batch_stride", "dst_row_stride", "dst_col_stride", "num_row_blocks", "num_col_blocks"]
unit = {"src_col_stride": 1, "dst_col_stride": 1, "BLOCK_R": 1, "BLOCK_C": 4096}
accesses = {}
for src, dst in [("fp32", "bf16"), ("bf16", "bf16"), ("fp16", "bf16"), ("bf16", "fp32")]:
    signature = {"src_ptr": "*" + src, "dst_ptr": "*" + dst, **{name: "i64" for name in ints}}
    signature.update({name: "constexpr" for name in unit})
    # What Triton's launcher specializes at run time for pointers and ints divisible by 16.
    aligned = [i for i, name in enumerate(signature) if signature[name] != "constexpr"]
    source = ASTSource(fn=strided_copy_kernel, signature=signature, constexprs=unit,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    accesses[src + "->" + dst] = sorted(set(re.findall(r"(?:ld|st)\.global[\w.]*", ptx)))
print(json.dumps(accesses))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton has no NVIDIA backend"
)
def test_kernel_compiles_for_sm90_with_vector_accesses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    accesses = json.loads(result.stdout.strip().splitlines()[-1])
    for conversion, instructions in accesses.items():
        assert "ld.global.v4.b32" in instructions and "st.global.v4.b32" in instructions, (
            conversion,
            instructions,
        )
