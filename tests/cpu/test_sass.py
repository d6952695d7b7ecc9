"""CPU test of the compiled kernel itself: its SASS must carry the V5 signature.

Reads the extension that was installed, so it checks what users run. Needs cuobjdump
and nvdisasm (PyPI: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm; the test extra).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import pytest

import jax_hopper
from jax_hopper import _ffi

# Disassembling the whole extension takes tens of seconds: the slow tier.
pytestmark = pytest.mark.slow

V5_SIGNATURE = [
    "HGMMA.64x256x16.F32",  # wgmma m64n256k16, f32 accumulate
    "UTMALDG",  # TMA loads
    "SYNCS",  # mbarrier operations
    "NANOSLEEP.SYNCS",  # a wait's retry sleeps on the barrier (try_wait's suspend-time hint), not spins
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # wgmma.wait_group(1): one group kept in flight
]


def _tool(name):
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            for cand in pathlib.Path(root).glob(f"*/bin/{name}"):
                return str(cand)
    except ImportError:
        pass
    return None


@pytest.fixture(scope="module")
def extension_path():
    if not jax_hopper.kernel_available():
        if shutil.which("nvcc"):
            pytest.fail(f"nvcc is on PATH but the kernel is not built: {_ffi.missing_kernel_reason()}")
        pytest.skip("the CUDA kernel is not built here (no nvcc at install time)")
    return _ffi._jax_hopper.__file__


def _need(name):
    path = _tool(name)
    if path is None:
        pytest.skip(f"{name} not found (pip install nvidia-cuda-{name})")
    return path


def _kernels(sass: str) -> dict[str, str]:
    """Splits a SASS dump into {mangled kernel name: body}."""
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# What each kernel kind (cuda/gemm/gemm.h: KernelKind, mangled as KernelKindE<n>E) adds
# to the V5 signature, by SASS instruction.
MULTICAST = "UTMALDG.3D.MULTICAST"  # B shared across the 2-CTA cluster
TMA_STORE = ["UTMASTG", "STSM"]  # stmatrix into swizzled smem, then TMA store
SETMAXNREG = "USETMAXREG"  # producer -> consumer register reallocation
KIND_EXTRAS = {
    0: [],  # V5
    1: [MULTICAST, *TMA_STORE, SETMAXNREG, "REDUX", "ATOMG"],  # persistent (the default: tiles by ticket)
    2: [MULTICAST],  # persistent_basic
    3: [MULTICAST, *TMA_STORE],  # persistent_tma
    4: [MULTICAST, *TMA_STORE, SETMAXNREG],  # persistent_wait0
    5: [MULTICAST, *TMA_STORE, SETMAXNREG, "REDUX", "ATOMG"],  # persistent_fused (dense: bias, activation, residual)
    6: [MULTICAST, *TMA_STORE, SETMAXNREG],  # persistent_streamk (stream-K tail)
    7: [MULTICAST, *TMA_STORE, SETMAXNREG],  # persistent_f16acc (opt-in f16 accumulation)
    8: [*TMA_STORE, "ATOMG", "LDGSTS", "UCGABAR_ARV"],  # small_m (split K: summed in a cluster or by the last piece)
    9: [MULTICAST, *TMA_STORE, SETMAXNREG],  # persistent_pingpong (experimental: 128x128 per warpgroup)
    10: [MULTICAST, *TMA_STORE, SETMAXNREG, "REDUX", "ATOMG"],  # persistent_fused_grad (the MLP's backward form)
    11: [MULTICAST, *TMA_STORE, SETMAXNREG, "REDUX", "ATOMG"],  # persistent_fused_derivative (act and act' written)
    12: [MULTICAST, *TMA_STORE, SETMAXNREG],  # persistent_immediate (the static order, stores not deferred)
    13: [MULTICAST, *TMA_STORE, SETMAXNREG],  # persistent_static (the default, grid-stride tile order)
    14: [MULTICAST, "STSM", SETMAXNREG],  # grouped (ragged rows: the deferred store staged by stmatrix, no TMA store)
    15: [MULTICAST, "STSM", SETMAXNREG],  # grouped_k (the ragged contraction)
}
GROUPED_KINDS = {14, 15}
F16_ACCUMULATION_KIND = 7
PINGPONG_KIND = 9
SMALL_M_KIND = 8
F32_MMA, F16_MMA = "HGMMA.64x256x16.F32", "HGMMA.64x256x16.F16"
F32_MMA_N128 = "HGMMA.64x128x16.F32"  # the ping-pong and small-M kinds' 128-column tiles
N128_KINDS = {PINGPONG_KIND, SMALL_M_KIND}
# Threads per CTA of the register-reallocating kinds: a producer warpgroup and two
# consumer warpgroups, four in the f16-accumulating kind.
KIND_THREADS = {F16_ACCUMULATION_KIND: 640}
SETMAXNREG_THREADS = 384
WAIT_ONE = "WARPGROUP.DEPBAR.LE gsb0, 0x1"
# wait_group(0) kinds: persistent_wait0 (the ablation) and persistent_fused_grad (its
# 3-stage ring needs the stage a group in flight would hold; config.cuh).
WAIT0_KINDS = {4, 10}


def test_cuobjdump_sass_has_v5_signature(extension_path):
    sass = subprocess.run([_need("cuobjdump"), "-sass", extension_path], check=True, capture_output=True,
                          text=True).stdout
    kernels = _kernels(sass)
    gemm_kernels = {k: v for k, v in kernels.items() if "gemm_kernel" in k or "grouped_kernel" in k}
    assert gemm_kernels, f"no gemm kernel in {extension_path}"
    kinds_seen = set()
    for name, body in gemm_kernels.items():
        kind = int(re.search(r"KernelKindE(\d+)E", name).group(1))
        kinds_seen.add(kind)
        signature = [s for s in V5_SIGNATURE if kind not in WAIT0_KINDS or s != WAIT_ONE] + KIND_EXTRAS[kind]
        if kind == F16_ACCUMULATION_KIND:  # f16 accumulator, never the f32 one
            signature = [F16_MMA if s == F32_MMA else s for s in signature]
            assert F32_MMA not in body, name
        if kind in N128_KINDS:  # 128-column tiles: n128 wgmmas only
            signature = [F32_MMA_N128 if s == F32_MMA else s for s in signature]
            assert F32_MMA not in body, name
        for needle in signature:
            assert needle in body, f"{needle} missing from {name}"
        if kind in GROUPED_KINDS:  # tiles cross groups: never a whole-box TMA store
            assert "UTMASTG" not in body, name
        if kind in WAIT0_KINDS:  # wait_group(0) only: nothing left in flight
            assert WAIT_ONE not in body, name
        # No local memory: the 128-register accumulator stays in registers.
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory traffic in {name}"
    assert {0, 1} <= kinds_seen, f"V5 or the default persistent kernel missing: {sorted(kinds_seen)}"
    assert GROUPED_KINDS <= kinds_seen, f"a grouped kernel missing: {sorted(kinds_seen)}"


REGISTER_FILE = 65536


def test_register_reallocating_kernels_hold_the_whole_register_pool(extension_path):
    # setmaxnreg.inc (consumers to 232) only succeeds if the CTA was launched with the
    # registers the producer gives back plus its own: 384 threads x 168 (640 x 96 with
    # four consumer warpgroups). A kernel built with fewer registers per thread would
    # hang, not fail.
    usage = subprocess.run([_need("cuobjdump"), "--dump-resource-usage", extension_path], check=True,
                           capture_output=True, text=True).stdout
    regs = dict(re.findall(r"Function (\S+):\s*REG:(\d+)", usage))
    reallocating = [name for name in regs
                    if int(re.search(r"KernelKindE(\d+)E", name).group(1)) in
                    [k for k, extras in KIND_EXTRAS.items() if SETMAXNREG in extras]]
    assert reallocating, "no setmaxnreg kernel found"
    for name in reallocating:
        threads = KIND_THREADS.get(int(re.search(r"KernelKindE(\d+)E", name).group(1)), SETMAXNREG_THREADS)
        expected = REGISTER_FILE // threads // 8 * 8
        assert int(regs[name]) == expected, f"{name}: {regs[name]} registers, the pool needs {expected}"


def test_nvdisasm_sees_wgmma_in_the_cubins(extension_path):
    cuobjdump, nvdisasm = _need("cuobjdump"), _need("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([cuobjdump, "-xelf", "all", extension_path], check=True, capture_output=True, cwd=tmp)
        cubins = sorted(pathlib.Path(tmp).glob("*.cubin"))
        assert cubins, "no sm_90a cubin embedded"
        for cubin in cubins:
            assert "sm_90a" in cubin.name, cubin.name
            text = subprocess.run([nvdisasm, "-c", os.fspath(cubin)], check=True, capture_output=True,
                                  text=True).stdout
            assert (F32_MMA in text or F16_MMA in text or F32_MMA_N128 in text) and "UTMALDG" in text
