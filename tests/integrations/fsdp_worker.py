"""FSDP2 on 2 gloo ranks (run under torchrun by test_fsdp): fuseblock's ResidualStack and the
GPT built on the meta device, sharded by fully_shard, moved with to_empty and initialised;
then their sharded gradients against one process's. Rank 0 writes its findings as JSON to
argv[1]; the test asserts on them."""
import gc
import json
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fuseblock
from models.gpt import GPT, GPTConfig

# units return Linear outputs (views), which the stack never changes in place (see models/build.py)
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
DIM = 9  # odd: every weight's rows split 5 + 4, so FSDP2 pads the second shard


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build_sharded(build, mesh, units: str) -> nn.Module:
    """build() on the meta device; each block (units="blocks") or each block's mixer
    ("mixers") a unit of its own, and the root one; to_empty on the CPU, then NaN in every
    shard, as memory from to_empty may hold: what initialisation leaves of it shows."""
    with torch.device("meta"):
        model = build()
    for block in (model.stack if isinstance(model, GPT) else model).blocks:
        fully_shard(block if units == "blocks" else block.mixer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(math.nan)
    return model


def stack(fused: bool) -> fuseblock.ResidualStack:
    mixers = [nn.Linear(DIM, DIM), nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))]
    return fuseblock.ResidualStack(mixers, DIM, kind="layer", bias=True, fused=fused)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def compare_gradients(sharded: nn.Module, plain: nn.Module, loss_of, inputs: list) -> dict:
    """Rank r's loss on inputs[r] under FSDP2 (which averages the gradients over the ranks)
    against one process's mean of the ranks' losses; the same weights in both."""
    rank, float_in = dist.get_rank(), inputs[0].is_floating_point()
    mine = inputs[rank].clone().requires_grad_(float_in)
    loss = loss_of(sharded, mine)
    loss.backward()
    theirs = [x.clone().requires_grad_(float_in) for x in inputs]
    ref_losses = [loss_of(plain, x) for x in theirs]
    (sum(ref_losses) / len(ref_losses)).backward()
    got = {n: whole(p.grad) for n, p in sharded.named_parameters()}
    want = {n: p.grad for n, p in plain.named_parameters()}
    out = {"grad_max_abs_diff": max_diff(got, want), "grad_max_abs": max(g.abs().max().item() for g in want.values()),
           "loss_diff": abs(loss.item() - ref_losses[rank].item())}
    if float_in:  # rank r's input gradient is its own loss's; the mean's holds half of it
        out["input_grad_max_abs_diff"] = (mine.grad - len(inputs) * theirs[rank].grad).abs().max().item()
    return out


def stack_case(mesh, fused: bool, units: str) -> dict:
    """fuseblock alone: a sharded ResidualStack given every module's reset_parameters(), as
    any model without an init of its own would be; then gradients."""
    model = build_sharded(lambda: stack(fused), mesh, units)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    norms = [m for m in model.modules() if isinstance(m, fuseblock.Norm)]
    norms_ok = len(norms) == len(model.blocks) + 1 and all(
        torch.equal(whole(m.weight), torch.ones(DIM)) and torch.equal(whole(m.bias), torch.zeros(DIM)) for m in norms)
    # nn.Linear's reset draws weight and bias from U(-1/sqrt(in_features), 1/sqrt(in_features))
    linears_ok = all(whole(t).abs().max() <= 1 / math.sqrt(m.in_features)  # False for NaN
                     for m in model.modules() if isinstance(m, nn.Linear) for t in (m.weight, m.bias))
    # the same full weights in both (torch's own loader), with norm weights off one so their gradients are generic
    torch.manual_seed(1)
    plain = stack(fused)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if ".norm" in n or n.startswith("norm_f"):
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.5)
    set_model_state_dict(model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    loaded = max_diff({n: whole(p.detach()) for n, p in model.named_parameters()}, dict(plain.named_parameters()))
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(2, 5, DIM, generator=gen) for _ in range(2)]
    weights = torch.randn(2, 5, DIM, generator=gen)
    grads = compare_gradients(model, plain, lambda m, x: (m(x) * weights).sum(), inputs)
    return {"norms_reset": norms_ok, "linears_reset": bool(linears_ok), "loaded_diff": loaded, **grads}


def gpt_case(mesh, cfg: GPTConfig, units: str) -> dict:
    """The GPT sharded and given its init_weights(): its full weights against GPT(cfg) from
    the same seed, then gradients."""
    torch.manual_seed(7)
    eager = GPT(cfg)
    torch.manual_seed(7)
    model = build_sharded(lambda: GPT(cfg), mesh, units)
    model.init_weights()
    sd = {n: whole(p.detach()) for n, p in model.named_parameters()}
    init_equal = sd.keys() == dict(eager.named_parameters()).keys() and all(
        torch.equal(sd[n], p) for n, p in eager.named_parameters())
    tied = model.lm_head.weight is model.wte.weight
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=gen) for _ in range(2)]
    grads = compare_gradients(model, eager, lambda m, b: m(b[:, :-1], b[:, 1:])[1], batches)
    return {"init_bit_equal": init_equal, "tied": tied, **grads}


def main() -> None:
    dump = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mine = {
        "stack_fused_block_units": stack_case(mesh, fused=True, units="blocks"),
        "stack_naive_mixer_units": stack_case(mesh, fused=False, units="mixers"),
        # fused: PreNormBlocks as units; naive: their mixers (as train.py --fsdp shards both forms),
        # since the naive stack runs a block's step without calling the block, past its unit's hooks
        "gpt_fused_block_units": gpt_case(
            mesh, GPTConfig(n_layer=2, n_head=2, n_embd=18, block_size=8, bias=True, norm="layer"), "blocks"),
        "gpt_naive_mixer_units": gpt_case(
            mesh, GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, fused=False), "mixers"),
        # fused with mixer units, as train.py shards it: the block hands its norm to the
        # mixer's own call (prenorm=), so the mixer unit's hooks gather its weights
        "gpt_fused_mixer_units": gpt_case(
            mesh, GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8), "mixers"),
        # n streams: a HyperBlock unit gathers its fn, base, scale and norm weight with its mixer;
        # the naive form calls the mixers only, so their units (the rest in the root's)
        "gpt_hc_fused_block_units": gpt_case(
            mesh, GPTConfig(n_layer=1, n_head=2, n_embd=10, block_size=8, hc=3), "blocks"),
        "gpt_hc_naive_mixer_units": gpt_case(
            mesh, GPTConfig(n_layer=1, n_head=2, n_embd=10, block_size=8, hc=2, fused=False), "mixers"),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        (dump / "fsdp.json").write_text(json.dumps(ranks, indent=1))
    gc.collect()  # the sharded models before their process group (see train.release_shards)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
