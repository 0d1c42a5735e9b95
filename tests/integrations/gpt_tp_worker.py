"""The GPT under models/tensor_parallel.py on 4 gloo ranks, a (dp 2, tp 2) mesh (run under
torchrun by test_gpt_tensor_parallel; the kernel path when TRITON_INTERPRET=1 is in the
environment): tensor-parallel alone on the "tp" dim (each dp row of the mesh a replica)
and FSDP2 on "dp" over it; the sharded model built on the meta device and initialised,
then one step's loss and every gradient against one process's. Rank 0 writes its findings
as JSON to argv[1]; the test asserts on them."""
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fuseblock.ops.dispatch
import fuseblock.ops.dtensor
from fuseblock.testing import interpreter_lang
from fuseblock.testing.interpreter_rounding import install
from models.gpt import GPT, GPTConfig
from models.tensor_parallel import fsdp_placement, parallelize

warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
CONFIGS = {
    "rms": GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8),
    "layer_bias": GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=8, norm="layer", bias=True),
}
FSDP_CONFIGS = {"rms": CONFIGS["rms"], "layer": GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=8, norm="layer")}


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(cfg, mesh, fsdp: bool) -> GPT:
    with torch.device("meta"):
        model = GPT(cfg)
    parallelize(model, mesh["tp"])
    if fsdp:
        for block in model.stack.blocks:
            fully_shard(block.mixer, mesh=mesh["dp"], shard_placement_fn=fsdp_placement)
        fully_shard(model, mesh=mesh["dp"], shard_placement_fn=fsdp_placement)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def case(cfg, mesh, fsdp: bool) -> dict:
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = build(cfg, mesh, fsdp)
    init = {n: whole(p) for n, p in model.named_parameters()}
    out = {"init_bit_equal": all(torch.equal(init[n], p) for n, p in ref.named_parameters()),
           "tied": model.lm_head.weight is model.wte.weight,
           "placements": {n: [str(x) for x in p.placements] for n, p in model.named_parameters()}}
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(cfg.vocab_size, (2, 2, cfg.block_size), generator=gen)  # one batch per dp rank
    tgt = torch.randint(cfg.vocab_size, (2, 2, cfg.block_size), generator=gen)
    d = mesh["dp"].get_local_rank()
    # tp alone: every replica the same batch (0); FSDP2 averages its two batches' gradients
    mine = d if fsdp else 0
    comm, fused = CommDebugMode(), []
    norm_linear = fuseblock.ops.dtensor.norm_linear

    def counted(*args, **kwargs):  # the blocks' norm + first Linear, one op on DTensors
        fused.append(1)
        return norm_linear(*args, **kwargs)

    fuseblock.ops.dtensor.norm_linear = counted
    try:
        with comm:
            logits, loss = model(idx[mine], tgt[mine])
            loss.backward()
    finally:
        fuseblock.ops.dtensor.norm_linear = norm_linear
    out["norm_linear_calls"] = len(fused)
    out["collectives"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    used = (0, 1) if fsdp else (0,)
    ref_out = [ref(idx[i], tgt[i]) for i in used]
    (sum(r[1] for r in ref_out) / len(used)).backward()
    got = {n: whole(p.grad) for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert got.keys() == want.keys()
    out["grad_max_abs_diff"] = max((got[n] - want[n]).abs().max().item() for n in want)
    out["grad_max_abs"] = max(g.abs().max().item() for g in want.values())
    out["worst"] = max(want, key=lambda n: (got[n] - want[n]).abs().max().item())
    out["loss_diff"] = abs(loss.item() - ref_out[used.index(mine)][1].item())
    out["logits_max_abs_diff"] = (logits - ref_out[used.index(mine)][0]).abs().max().item()
    out["logits_plain"] = not isinstance(logits, DTensor)
    return out


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    found = {"kernel_path": fuseblock.ops.dispatch.uses_triton(torch.empty(1))}
    for name, cfg in CONFIGS.items():
        found[f"{name}_tp"] = case(cfg, mesh, fsdp=False)
    for name, cfg in FSDP_CONFIGS.items():
        found[f"{name}_fsdp_tp"] = case(cfg, mesh, fsdp=True)
    try:
        build(CONFIGS["layer_bias"], mesh, fsdp=True)
        found["fsdp_bias_error"] = None
    except ValueError as e:
        found["fsdp_bias_error"] = str(e)
    with torch.device("meta"):
        odd = GPT(GPTConfig(n_layer=1, n_head=3, n_embd=12, block_size=8))
    try:
        parallelize(odd, mesh["tp"])
        found["odd_heads_error"] = None
    except ValueError as e:
        found["odd_heads_error"] = str(e)
    if dist.get_rank() == 0:
        Path(sys.argv[1], "gpt_tp.json").write_text(json.dumps(found, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    install()  # the interpreter rounds as a GPU does, as in the tests' own process (conftest)
    interpreter_lang.install()  # and patches its language once per launch (conftest)
    main()
