"""The structural check between a family's name and its fusion: `refusals(base, family)`.

A family's entry (families.py) says what its fused forward handles. A model of that
model_type is fused only if it is that: the inner model holds exactly the entry's
modules, every decoder layer exactly its roles' modules, every stream norm converts to a
fuseblock Norm, and every block scalar of the config that the forward does not read has
its neutral value, where the unfused model's code reads it. Anything else is a refusal
naming what differs, so that a family registered with another's forward, or a config
option the forward ignores, is an error rather than a silently different model.

Block scalars: the config entries whose names mark them as changing the residual block
(`_BLOCK_SCALAR`: dropouts, multipliers, parallel / post-norm / sandwich flags, scales,
cross-attention, bidirectional attention). Those consumed inside modules fuse leaves as
they are (the attention, the head; `_INSIDE`) need no check; the rest must be neutral
(None, False, 0 or 1) unless the family reads them. A key the unfused model's code does
not read is no reason (configs carry stray keys: BERT's hidden_dropout_prob in a GPT-NeoX
config changes neither model): `read_by_replaced_code` finds the names the code fuse
replaces mentions, in the installed transformers source.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import sys

from torch import nn

from ...convert import norm_from
from ...ops.hyper import MAX_STREAMS
from . import attn_res, gated, unit_sphere
from .families import Family

# (bidirectional: Gemma3's use_bidirectional_attention, masks the model forward does not build)
_BLOCK_SCALAR = re.compile(r"dropout|pdrop|multiplier|parallel|residual|sandwich|post_norm|post_layernorm|scal|cross"
                           r"|bidirectional")
# Block-scalar names that act inside modules fuse leaves untouched in every family
# (attention, rotary embedding, head), not on the residual stream
_INSIDE = frozenset({
    "attention_dropout", "attn_pdrop", "attention_multiplier", "query_pre_attn_scalar", "rope_scaling",
    "logits_scaling", "logit_scale", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "classifier_dropout",
    "summary_first_dropout", "summary_last_dropout", "scale_attention_softmax_in_fp32",
})
_NEUTRAL = (None, False, 0, 1)


def _neutral(value) -> bool:
    return isinstance(value, (bool, int, float, type(None))) and any(
        value is n or (type(value) is not bool and value == n) for n in _NEUTRAL)


def refusals(base: nn.Module, family: Family) -> list[str]:
    """Why `base` (the inner model: LlamaModel and its kin) is not what `family`'s fused
    forward computes; empty when it is. The attention-residual shape's layers are of several
    classes, which its own check holds to what its forward computes (attn_res.refusals); the
    gated shape's gates and norms are held to what its ops are given as well (gated.refusals)."""
    if family.shape is attn_res.ATTN_RES:
        return attn_res.refusals(base, family)
    if family.shape is unit_sphere.UNIT_SPHERE:  # its norms and rates are the modeling code's: its own check
        return unit_sphere.refusals(base, family)
    found = []
    children, expected = set(base._modules), set(family.model_parts.values())
    if children != expected:
        found.append(_differs(type(base).__name__, children, expected))
    layers = getattr(base, family.model_parts["layers"], None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return [*found, f"{type(base).__name__} has no decoder layers in {family.model_parts['layers']!r}"]
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1:
        found.append(f"its decoder layers are of several classes ({', '.join(sorted(k.__name__ for k in kinds))})")
    expected = set(family.parts.values())
    for i, layer in enumerate(layers):
        if set(layer._modules) != expected:
            found.append(_differs(f"layers[{i}] ({type(layer).__name__})", set(layer._modules), expected))
            break
        own = [n for n, t in (*layer._parameters.items(), *layer._buffers.items()) if t is not None]
        if own:  # a layer's own tensors (a learned residual scale, say) are read by its forward, not by fuse's
            found.append(f"layers[{i}] ({type(layer).__name__}) holds tensors of its own ({', '.join(own)})")
            break
    norms = [(f"{family.model_parts['layers']}[{i}].{family.parts[r]}", getattr(layer, family.parts[r], None))
             for i, layer in enumerate(layers) for r in family.norms]
    norms.append((family.model_parts["norm"], getattr(base, family.model_parts["norm"], None)))
    for name, norm in norms:
        try:
            norm_from(norm)
        except TypeError as e:
            found.append(f"{name} is no norm fuseblock computes ({e})")
            break
    if family.hyper is not None:
        found += _hyper_refusals(base, layers, family)
    found += _same_across_layers(layers, family)
    found += [f"config.{key} = {getattr(base.config, key, None)!r}, where its fused forward ({family.shape.name}) "
              f"takes {value!r}" for key, value in family.requires.items() if getattr(base.config, key, None) != value]
    found += _unread_scalars(base.config, family, read_by_replaced_code(base, family))
    if family.shape is gated.GATED and not found:  # its gates and norms: what its ops are given
        found += gated.refusals(base, family)
    return found


def _hyper_refusals(base: nn.Module, layers, family: Family) -> list[str]:
    """Where an n-stream model differs from what the hc ops compute: a stream count out of
    their range, no Sinkhorn pass, a stream norm other than a weighted RMSNorm, or an
    hc module whose own unweighted norm of the streams takes another eps than the norm it
    meets in the op (the op holds one eps for both)."""
    found, n = [], getattr(base.config, "hc_mult", None)
    if not isinstance(n, int) or not 1 <= n <= MAX_STREAMS:
        found.append(f"config.hc_mult = {n!r}, where the hc ops take 1 to {MAX_STREAMS} streams")
    iters = getattr(base.config, "hc_sinkhorn_iters", 1)
    if not isinstance(iters, int) or iters < 1:
        found.append(f"config.hc_sinkhorn_iters = {iters!r}, where the hc ops take at least one Sinkhorn pass")
    head = getattr(base, family.model_parts["head"], None)
    pairs = [(f"{family.model_parts['layers']}[{i}].{family.parts[hc]}", getattr(layer, family.parts[hc], None),
              getattr(layer, family.parts[norm], None))
             for i, layer in enumerate(layers) for hc, norm in (("hc_1", "norm_1"), ("hc_2", "norm_2"))]
    if family.hyper.weighted_head:
        pairs.append((family.model_parts["head"], head, getattr(base, family.model_parts["norm"], None)))
    for name, hc, norm in pairs:
        try:
            fused = norm_from(norm)
        except TypeError:
            continue  # refusals() names it
        if fused.kind != "rms" or fused.weight is None or fused.bias is not None or fused.weight_offset != 0.0:
            found.append(f"the norm after {name} is not a weighted RMSNorm (the hc ops' norm)")
            break
        eps = getattr(getattr(hc, "input_norm", None), "eps", None)
        if eps != fused.eps:
            found.append(f"{name}.input_norm.eps = {eps!r}, where the norm it meets takes eps = {fused.eps!r}")
            break
    return found


def _differs(what: str, have: set, expected: set) -> str:
    extra, lacking = sorted(have - expected), sorted(expected - have)
    return (f"{what} holds " + " and ".join(
        s for s in (f"modules the fused forward does not know ({', '.join(extra)})" if extra else "",
                    f"lacks {', '.join(lacking)}" if lacking else "") if s))


def _same_across_layers(layers, family: Family) -> list[str]:
    """The branch p carries is read off the layer that receives p (layers.py), so every
    layer must carry the same scale and dropouts, each dropout an nn.Dropout."""
    found = []
    if family.alpha is not None:
        values = {float(getattr(layer, family.alpha)) for layer in layers}
        if len(values) != 1:
            found.append(f"its layers' {family.alpha} differ ({sorted(values)})")
    for name in (family.dropout or {}).values():
        modules = [getattr(layer, name) for layer in layers]
        if not all(isinstance(m, nn.Dropout) for m in modules) or len({m.p for m in modules}) != 1:
            found.append(f"its layers' {name} are not one nn.Dropout probability")
    return found


def read_by_replaced_code(base: nn.Module, family: Family) -> frozenset[str] | None:
    """The config attributes (`config.key`, `self.config.key`, ...) and the strings
    (`getattr(config, "key")`) of the transformers code that fuse replaces or stops
    running: the classes (and their transformers bases) of the inner model, of its decoder
    layers and of its stream norms, and the module-level functions and statements of their
    modeling files, which those classes may call. The other classes of those files
    (attention, MLP, the heads, the other tasks' models) run unchanged in the fused model:
    what they read they still honour. A superset of what that code reads (a name counts
    whatever uses it); None where a file's source cannot be read: then every key counts."""
    classes = [type(base), *{type(layer) for layer in getattr(base, family.model_parts["layers"])}]
    classes += [type(getattr(layer, family.parts[r])) for layer in getattr(base, family.model_parts["layers"])[:1]
                for r in family.norms]
    classes.append(type(getattr(base, family.model_parts["norm"])))
    wanted: dict[str, set[str]] = {}
    for cls in classes:
        for c in cls.__mro__:
            if c.__module__.startswith("transformers.models."):
                wanted.setdefault(c.__module__, set()).add(c.__qualname__.split(".")[0])
    names: set[str] = set()
    for module, kept in wanted.items():
        read = _names_in(module, frozenset(kept))
        if read is None:
            return None
        names |= read
    return frozenset(names)


@functools.cache
def _names_in(module: str, classes: frozenset[str]) -> frozenset[str] | None:
    """The attributes of config objects and the string constants in `module`'s source,
    outside its classes other than `classes`."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return None
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name not in classes:
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and re.search(r"config|cfg", ast.unparse(n.value), re.IGNORECASE):
                names.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                names.add(n.value)
    return frozenset(names)


def _unread_scalars(config, family: Family, read: frozenset[str] | None) -> list[str]:
    """The config's block scalars with a value that changes the block, which the code fuse
    replaces reads (`read`; None: all) and the fused forward neither reads nor leaves to a
    module fuse does not touch. A key is read under its name or an alias of it
    (config.attribute_map)."""
    aliases: dict[str, set[str]] = {}
    for alias, key in getattr(config, "attribute_map", {}).items():
        aliases.setdefault(key, set()).add(alias)
    found = []
    for key, value in sorted(config.to_dict().items()):
        if (_BLOCK_SCALAR.search(key) and key not in _INSIDE and key not in family.reads and key not in family.requires
                and not _neutral(value) and (read is None or not read.isdisjoint({key, *aliases.get(key, ())}))):
            found.append(f"config.{key} = {value!r}, which its fused forward does not read (the unfused model's "
                         f"code does)")
    return found
