"""The unit-sphere shape (nGPT; transformers 5.24's dory) on fuseblock's interpolating norm_add_norm.

A Dory decoder layer keeps the stream on the unit sphere: each norm is an L2 norm with no
weight, N(x) = x * rsqrt(x.x + eps) (DoryL2Norm), whose output replaces the stream, and each
update interpolates towards the normalized branch at learned per-channel rates:

    h = N1(h0);   h1 = h + |l1 s| (x) (Na(attn(h)) - h)
    h' = N2(h1);  h2 = h' + |l2 s| (x) (Nm(mlp(h')) - h')          -> h2, the layer's output

Fused, each update and the norm after it are one `norm_add_norm(update="interpolate")`: the
attention's with N2, the MLP's with the norm the next layer (or the model) applies to h2
first, so the layer takes h0 and, where the op before it gave it, N1(h0) (`normed`), and
returns (h2, N(h2)). The model forward (`unit_sphere_forward`, DoryModel.forward's) runs the
input layers, config.n_recurrent_loops passes of the recurrent layers, each entered with
norm(h) + the input layers' normed output, and the output layers, the stream passed on as
(h, N(h)); norm(h) is N(h) wherever an op gave it, else the model's norm of h (the loops'
entries, which the modeling code normalizes twice: so does the fused forward, bitwise).

The torch path of the op takes DoryDecoderLayer's order of operations, so fp32 is the
unfused model bit for bit. The norms stay the modeling code's modules (DoryL2Norm is no
norm fuseblock converts: its eps is on the sum of squares), read for their eps; the rates
|lambda * lambda_scale| are formed as the layer forms them, so their gradients reach
lambda_1 and lambda_2 through the same ops. Attention, MLP, rotary embeddings, masks and
the KV cache (per loop or last loop) are the modeling code's.

Nothing here imports the family's modeling code (5.23 has none): layers and norms are told
by their class names.
"""
from __future__ import annotations

import copy

from torch import Tensor, nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ...ops.norm_add import norm_add_norm
from .layers import SUM, Shape, module
from .versions import CACHE, one_cache

LAYER_CLASS = "DoryDecoderLayer"
NORM_CLASS = "DoryL2Norm"
RATES = ("lambda_1", "lambda_2")


def _update(branch: Tensor, h: Tensor, rate: Tensor, branch_norm: nn.Module, norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(norm(h'), h') with h' = h + rate (x) (branch_norm(branch) - h), in one op."""
    return norm_add_norm(branch, h, None, None, kind="l2", eps=norm.eps, branch_eps=branch_norm.eps,
                         branch_scale=rate, update="interpolate")


def _unit_sphere(self, hidden_states: Tensor | None, normed: Tensor | None = None, **kwargs):
    """A DoryDecoderLayer on the fused updates (see the module docstring): takes h0 and N1(h0)
    where the op before it gave it (else None: the layer's input_layernorm normalizes h0), and
    returns (h2, N(h2)), N the next input norm (every layer's and the model's: one eps)."""
    kwargs.pop(SUM, None)  # the output h2 is the unfused layer's: recorded as it is
    h = module(self, "norm_1")(hidden_states) if normed is None else normed
    attn, _ = module(self, "attn")(h, **kwargs)
    h = _update(attn, h, (self.lambda_1 * self.lambda_scale).abs(), module(self, "post_attn"),
                module(self, "norm_2"))[0]
    mlp = module(self, "mlp")(h)
    normed, h = _update(mlp, h, (self.lambda_2 * self.lambda_scale).abs(), module(self, "post_mlp"),
                        module(self, "norm_1"))
    return h, normed


UNIT_SPHERE = Shape("unit sphere (nGPT)", _unit_sphere, None,
                    frozenset({"norm_1", "attn", "post_attn", "norm_2", "mlp", "post_mlp"}))


def unit_sphere_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                        use_cache=None, **kwargs):
    """DoryModel.forward on the fused layers: its embeddings, cache, masks, rotary embeddings
    and recurrent loops as it builds them, the stream passed on as (h, N(h)) (see the module
    docstring). The cache comes as `cache` or `past_key_values`, as stream_forward's."""
    cache = one_cache(cache, kwargs)
    config = self.config
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if use_cache and cache is None:
        cache = DynamicCache(config=config)
    position_ids = self.fuseblock_family.positions(self, position_ids, inputs_embeds, cache)[1]
    masks = attention_mask
    if not isinstance(masks, dict):
        mask_kwargs = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                       CACHE: cache, "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**mask_kwargs),
                 "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs)}
    rotary = {kind: self.rotary_emb(inputs_embeds, position_ids, kind)
              for kind in {layer.attention_type for layer in self.layers}}

    n_loops, start, n_recurrent = config.n_recurrent_loops, config.n_input_layers, config.n_recurrent_layers
    end = start + n_recurrent
    last_loop_only = config.recurrent_kv_cache_mode == "last_loop"
    shared_kv_states = None
    if cache is not None and last_loop_only:  # only the last loop writes, the earlier ones read the past
        shared_kv_states = {i: (c.keys, c.values) for i, c in enumerate(cache.layers) if c.is_initialized}
    elif cache is not None and len(cache.layers) == config.num_hidden_layers:
        # loops 1, 2, ... write to copies of the recurrent cache layers, appended at the end
        cache.layers += [copy.deepcopy(c) for c in cache.layers[start:end] * (n_loops - 1)]

    stream = (inputs_embeds, None)  # (h, N(h) or None), positional: reentrant checkpointing's gradients

    def run(layers, **extra):
        nonlocal stream
        for layer in layers:
            stream = layer(*stream, attention_mask=masks[layer.attention_type],
                           position_embeddings=rotary[layer.attention_type], **{CACHE: cache}, **extra, **kwargs)

    def norm_of_stream():
        return self.norm(stream[0]) if stream[1] is None else stream[1]

    run(self.layers[:start])
    offset = len(self.layers) - start - n_recurrent
    input_hidden = norm_of_stream()  # each loop restarts from the input section's output
    for loop_idx in range(n_loops):
        # the modeling code normalizes h again here, where the input section's norm of it is input_hidden
        entry = self.norm(stream[0]) if loop_idx == 0 else norm_of_stream()
        stream = (entry + input_hidden, None)
        cache_offset = 0 if loop_idx == 0 or last_loop_only else offset + loop_idx * n_recurrent
        run(self.layers[start:end], cache_offset=cache_offset,
            shared_kv_states=shared_kv_states if loop_idx < n_loops - 1 else None)
    run(self.layers[config.num_hidden_layers - config.n_output_layers:])
    return self.fuseblock_family.output(last_hidden_state=norm_of_stream(), **{CACHE: cache})


UNIT_SPHERE_MODEL_FORWARD = merge_with_config_defaults(capture_outputs(unit_sphere_forward))


def refusals(base: nn.Module, family) -> list[str]:
    """Where a Dory model differs from what the fused forwards compute; empty when it does
    not: the inner model's modules, each layer a DoryDecoderLayer of the family's modules
    with its two [d] rates, every stream norm a DoryL2Norm, and one eps for the norms each
    layer's last op applies for the next (every input norm and the model's)."""
    found = []
    children, expected = set(base._modules), set(family.model_parts.values())
    if children != expected:
        found.append(f"{type(base).__name__} holds modules {sorted(children)}, where its fused forward takes "
                     f"{sorted(expected)}")
    layers = getattr(base, family.model_parts["layers"], None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return [*found, f"{type(base).__name__} has no decoder layers in {family.model_parts['layers']!r}"]
    d, parts = base.config.hidden_size, set(family.parts.values())
    norm = getattr(base, family.model_parts["norm"], None)
    norms = [(family.model_parts["norm"], norm)]
    for i, layer in enumerate(layers):
        name = f"{family.model_parts['layers']}[{i}]"
        if type(layer).__name__ != LAYER_CLASS:
            found.append(f"{name} is a {type(layer).__name__}, not the decoder layer the fused forward computes "
                         f"({LAYER_CLASS})")
            break
        if set(layer._modules) != parts:
            found.append(f"{name} holds modules {sorted(layer._modules)}, where its fused forward takes "
                         f"{sorted(parts)}")
            break
        own = sorted(n for n, t in (*layer._parameters.items(), *layer._buffers.items()) if t is not None)
        rates_ok = all(tuple(getattr(layer, r).shape) == (d,) for r in RATES if r in own)
        if own != sorted(RATES) or not rates_ok or not isinstance(getattr(layer, "lambda_scale", None), float):
            found.append(f"{name} holds tensors {own} (lambda_scale {getattr(layer, 'lambda_scale', None)!r}), where "
                         f"the fused forward takes the rates lambda_1 and lambda_2 ({d},) and a float lambda_scale")
            break
        norms += [(f"{name}.{family.parts[r]}", getattr(layer, family.parts[r])) for r in family.norms]
    for name, m in norms:
        eps = getattr(m, "eps", None)
        if (type(m).__name__ != NORM_CLASS or any(True for _ in m.parameters()) or isinstance(eps, bool)
                or not isinstance(eps, (int, float)) or eps < 0):
            found.append(f"{name} is a {type(m).__name__}, where the op computes the unit-sphere L2 norm of "
                         f"{NORM_CLASS} (no parameters, an eps >= 0)")
            return found
    # the last op of each layer applies the next input norm (or the model's): one eps for all
    entry = {norm.eps, *(getattr(layer, family.parts["norm_1"]).eps for layer in layers)}
    if len(entry) != 1:
        found.append(f"the layers' {family.parts['norm_1']} and the model's {family.model_parts['norm']} take "
                     f"several eps ({sorted(entry)}), where each layer's last op applies the next one's")
    return found
