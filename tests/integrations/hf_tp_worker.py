"""A fused Llama under transformers' own tensor-parallel plan, on 2 gloo ranks (run under
torchrun by test_hf_tensor_parallel, once per path: the kernel path when TRITON_INTERPRET=1
is in the environment). Rank 0 saves a tiny random LlamaForCausalLM to argv[1]; every rank
loads it twice: once as one process's fused model, once distributed by transformers'
plan (`model.tp_plan`: attention and MLP column/row-parallel, the embedding and head
sharded) and fused, in both orders. The logits, the loss and every gradient are compared
with one process's; rank 0 writes the findings as JSON to argv[1]/hf_tp.json."""
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig, initialize_distributed_mesh

import fuseblock
from fuseblock.integrations.transformers import fuse
from fuseblock.testing import interpreter_lang
from fuseblock.testing.interpreter_rounding import install

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=64, tie_word_embeddings=False)


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_diff(got, want) -> float:
    got = whole(got)
    return ((got.double() - want.double()).abs().max() / max(1.0, want.abs().max().item())).item()


def distributed(path: Path, fuse_first: bool):
    """The checkpoint under transformers' plan: what from_pretrained(distributed_config=
    DistributedConfig(tp_size=2)) does, in its two steps (that call needs accelerate)."""
    config = DistributedConfig(tp_size=dist.get_world_size())
    _, meshes = initialize_distributed_mesh(config)
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    if fuse_first:
        fuse(model)
    model = transformers.LlamaForCausalLM.maybe_distribute_model(model, config, meshes)
    return model if fuse_first else fuse(model)


def compare(one, tp, ids) -> dict:
    want = one(input_ids=ids, labels=ids)
    want.loss.backward()
    got = tp(input_ids=ids, labels=ids)
    got.loss.backward()
    mine = dict(one.named_parameters())
    grads = {n: rel_diff(p.grad, mine[n].grad) for n, p in tp.named_parameters()}
    layer = tp.model.layers[0]
    return {"logits": rel_diff(got.logits, want.logits), "loss": abs(got.loss.item() - want.loss.item()),
            "loss_value": want.loss.item(), "grads": grads, "grad_max": max(grads.values()),
            "all_params": sorted(grads) == sorted(mine),
            "placements": {n: str(m.weight.placements) if isinstance(m.weight, DTensor) else "plain"
                           for n, m in (("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
                                        ("down_proj", layer.mlp.down_proj), ("lm_head", tp.lm_head))},
            "norms_fused": all(isinstance(m, fuseblock.Norm) for m in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm, tp.model.norm))}


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    path = out / "llama"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        with torch.no_grad():  # norms away from ones: their gradients tell
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.2 * torch.randn(p.shape))
        model.save_pretrained(path)
    dist.barrier()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    one = fuse(transformers.LlamaForCausalLM.from_pretrained(path))
    found = {"kernel_path": fuseblock.ops.dispatch.uses_triton(torch.empty(1))}
    for order, fuse_first in (("fuse_then_plan", True), ("plan_then_fuse", False)):
        one.zero_grad()
        found[order] = compare(one, distributed(path, fuse_first), ids)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, found)
    if dist.get_rank() == 0:
        (out / "hf_tp.json").write_text(json.dumps(ranks, indent=1))
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    install()  # the interpreter rounds as a GPU does, as in the tests' own process (conftest)
    interpreter_lang.install()  # and patches its language once per launch (conftest)
    main()
