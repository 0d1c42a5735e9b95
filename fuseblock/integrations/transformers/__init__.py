"""Hugging Face transformers models on the fused residual stream: `fuse(model)`.

A pre-norm decoder layer of transformers computes

    h = x + attn(norm_1(x));  x' = h + mlp(norm_2(h))

and its model ends with norm_f(x_n): per layer two residual adds and two norms, each
reading the whole hidden state. Fused, each layer carries (p, r) as docs/stream.md
describes: it receives the previous layer's MLP output p un-added and the residual r,
and each add meets the norm after it in one `add_norm`:

    normed, r = add_norm(p, r, norm_1);  p = attn(normed)
    normed, r = add_norm(p, r, norm_2);  p = mlp(normed)        -> (p, r) to the next layer

and the model's final norm folds in the last add: norm_f(p + r) is one more add_norm.
The other stream shapes of docs/stream.md (scaled and parallel branches, branch dropout,
post-norm, sandwich) carry the same (p, r), each add with its norms in one op.

The package, one concept a file:
- `families`: what fuse knows of each family (`Family`, `FAMILIES`): its stream shape,
  its modules by role, the config scalars its fused forward reads;
- `refused`: why fuse refuses the others (`REFUSED`);
- `check`: the structural check that stands between a family's name and its fusion;
- `layers`: the fused decoder-layer forwards, one per stream shape;
- `attn_res`: the attention-residual shape (5.24's inkling2_loop): its layer forward on the
  attn_res ops and its check;
- `gated`: the per-channel gated sandwich (muse_spark): its layer forward on the ops' [d]
  residual_scale / branch_scale and its check;
- `unit_sphere`: the unit-sphere shape (5.24's dory, nGPT): its layer and model forwards on
  the interpolating norm_add_norm, and its check;
- `model`: the fused forward of the inner model (LlamaModel and its kin);
- `fusion`: `fuse` itself: norms converted, layers and models re-classed (forwards, init);
- `versions`: the transformers versions fuse is tested with (5.17 to 5.24; fuse refuses
  others) and what differs between them (the KV cache's keyword).
"""
from __future__ import annotations

try:
    import transformers
except ImportError as e:
    raise ImportError("fuseblock.integrations.transformers needs transformers 5.17 to 5.24 "
                      f"(pip install 'transformers>=5.17,<5.25'): {e}") from e
if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 17):  # layers returned tuples before 5
    raise ImportError(f"fuseblock.integrations.transformers needs transformers >= 5.17, found "
                      f"{transformers.__version__}")

from .families import FAMILIES, SUPPORTED, WRAPPERS, Family  # noqa: E402
from .fusion import fuse  # noqa: E402
from .refused import REFUSED  # noqa: E402

__all__ = ["fuse", "SUPPORTED", "FAMILIES", "REFUSED", "WRAPPERS", "Family"]
