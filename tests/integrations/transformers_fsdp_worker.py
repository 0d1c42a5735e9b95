"""FSDP2 on 2 gloo ranks (run under torchrun by test_transformers): a fused and an unfused
transformers model, each built on the meta device, sharded by fully_shard (each decoder
layer a unit, and the root), moved with to_empty, NaN in every shard (what to_empty's
memory may hold), then init_weights() from one seed. Rank 0 writes its findings as JSON
to argv[1]; the test asserts on them."""
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fuseblock import Norm
from fuseblock.integrations.transformers import fuse

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, vocab_size=64, tie_word_embeddings=False)
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
         "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(query_pre_attn_scalar=16))}  # weight_offset=1


def build(arch: str, fused: bool, mesh):
    config_cls, model_cls, extra = ARCHS[arch]
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**CONFIG, **extra))
        if fused:
            fuse(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(math.nan)
    torch.manual_seed(7)
    model.init_weights()
    return model


def whole(model) -> dict:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    found = {}
    for arch in ARCHS:
        unfused, fused = build(arch, False, mesh), build(arch, True, mesh)
        a, b = whole(unfused), whole(fused)
        norms = {n for n, m in fused.named_modules() if isinstance(m, Norm)}
        found[arch] = {
            "same_names": list(a) == list(b),
            "differing": [n for n in a if not torch.equal(a[n], b[n])],
            "nan": [n for n in b if torch.isnan(b[n]).any()],
            "norm_values": sorted({v for n in b if n.rsplit(".", 1)[0] in norms for v in b[n].unique().tolist()}),
            "losses": [m(input_ids=ids, labels=ids).loss.item() for m in (unfused, fused)],
        }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
