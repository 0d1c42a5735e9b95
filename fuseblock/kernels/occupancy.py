"""Programs per SM: how many of a compiled kernel's programs an SM holds at once.

The persistent kernels (the backward's, the wide-row forward's) split the rows among a
fixed number of programs per SM. Launch more than an SM holds and the rest run as a
second, partly idle wave: with 3 resident where 4 were launched, a quarter of the
programs start only when the first ones finish, and the pass takes about 1.5x as long.
(On an H100 with Triton 3.6, LayerNorm's backward at d = 1024 ran at 0.68 TB/s and
RMSNorm's at 1.02. Compiled with Triton 3.9, both need 136 to 166 registers per thread,
so 3 programs fit where the grid launched 4 per SM; register counts change with the
Triton version and the variant, so they are learned, not tabulated.
`python scripts/bench.py targets` shows every variant on every target.)

Registers per thread are known only once a kernel is compiled, so the first launch of
each variant records what fits (`learn`), and its later launches cap their grid at that
(`programs_per_sm`). Under the interpreter nothing is compiled and the defaults stand.
"""
from __future__ import annotations

import torch

# An H100 SM (as A100 and H200): 64K 32-bit registers, allocated per warp in steps of
# 256; 2048 threads; 32 resident blocks; 228 KB of shared memory, 1 KB of it reserved
# per block.
H100_SM = dict(registers=65536, threads=2048, blocks=32, shared=233472, shared_per_block_reserved=1024)
B200_SM = H100_SM  # sm_100: the same limits per SM
RTX5090_SM = dict(H100_SM, threads=1536, shared=102400)  # sm_120: 48 warps, 100 KB of shared memory
# An AMD CDNA3 CU (MI300X, gfx942): 4 SIMDs, each 512 VGPRs per lane (the architectural and
# accumulation registers together), allocated in steps of 8, and at most 8 wavefronts; a
# workgroup's wavefronts are spread over the 4 SIMDs; 64 KB of LDS. MI355X (gfx950): 160 KB.
MI300X_CU = dict(simds=4, vgprs=512, vgpr_granule=8, waves_per_simd=8, lds=65536)
MI355X_CU = dict(MI300X_CU, lds=163840)
MACHINE = H100_SM  # what `learn` assumes of a device it cannot ask (offline compiles set their target's)

_RESIDENT: dict[tuple, int] = {}  # (torch.device, kernel variant) -> programs per SM
# Bumped whenever what programs_per_sm answers may change (learn, forget): launchers that
# keep a launch's grid (`fuseblock.kernels.norm`'s plans) key it by this
GENERATION = 0


def resident_programs(usage: dict[str, int], num_warps: int, sm: dict = H100_SM) -> int:
    """Programs an SM (a CU, for an AMD `sm`) holds at once, given a kernel's 'registers' per
    thread (VGPRs per lane) and 'shared' bytes (LDS) per program: the CUDA occupancy rule,
    or AMD's."""
    if "simds" in sm:
        alloc = -(-max(usage["registers"], 1) // sm["vgpr_granule"]) * sm["vgpr_granule"]
        per_simd = min(sm["waves_per_simd"], sm["vgprs"] // alloc)
        by_lds = sm["lds"] // usage["shared"] if usage["shared"] else per_simd * sm["simds"]
        return min(per_simd * sm["simds"] // num_warps, by_lds)
    regs_per_warp = -(-usage["registers"] * 32 // 256) * 256
    by_regs = sm["registers"] // (regs_per_warp * num_warps)
    by_threads = sm["threads"] // (32 * num_warps)
    by_shared = sm["shared"] // (usage["shared"] + sm["shared_per_block_reserved"])
    return min(by_regs, by_threads, by_shared, sm["blocks"])


def forget() -> None:
    """Drop every learned programs-per-SM figure: the next launch of each variant starts
    from its default again (benchmarks that measure the first launch)."""
    global GENERATION
    _RESIDENT.clear()
    GENERATION += 1


def _sm(device: torch.device) -> dict:
    if device.type != "cuda":
        return MACHINE
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return MI355X_CU if "gfx950" in getattr(props, "gcnArchName", "") else MI300X_CU
    return dict(H100_SM, registers=getattr(props, "regs_per_multiprocessor", H100_SM["registers"]),
                threads=props.max_threads_per_multi_processor,
                shared=getattr(props, "shared_memory_per_multiprocessor", H100_SM["shared"]))


def programs_per_sm(device: torch.device, variant: tuple, default: int) -> int:
    """`default`, capped at what fits once a launch of this variant has been compiled."""
    return min(default, _RESIDENT.get((device, variant), default))


def learned(device: torch.device, variant: tuple) -> bool:
    """Whether a compiled launch of this variant has been learned from."""
    return (device, variant) in _RESIDENT


def learn(device: torch.device, variant: tuple, compiled, num_warps: int) -> None:
    """Record what fits from the compiled kernel a launch returns (on a GPU; under the
    interpreter it returns nothing, and nothing is learned)."""
    n_regs = getattr(compiled, "n_regs", None)
    key = (device, variant)
    if n_regs is None or key in _RESIDENT:
        return
    usage = {"registers": n_regs, "shared": compiled.metadata.shared}
    global GENERATION
    _RESIDENT[key] = max(1, resident_programs(usage, num_warps, _sm(device)))
    GENERATION += 1
