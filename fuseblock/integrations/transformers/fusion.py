"""`fuse(model)`: a transformers model put on the fused residual stream, in place.

`fuse` works on one model instance, with no class of transformers patched: a fused and an
unfused model live side by side in one process. It
- checks the model is what its family's entry says (check.py), else a ValueError naming
  the family and what differs;
- replaces every stream norm (and the RMSNorms inside the layers: Qwen3's q_norm / k_norm)
  by a fuseblock Norm (fuseblock.convert.norm_from) holding the same Parameters, so
  state_dict keys, checkpoints, tied weights and optimizers stay as they were (Gemma's
  x * (1 + w) is weight_offset=1);
- moves each decoder layer to a subclass of its own class (same name, created once per
  class and family) whose forward is its shape's fused one (layers.py): isinstance checks,
  gradient checkpointing (transformers' GradientCheckpointingLayer) and output-recording
  hooks still apply;
- moves the inner model to a subclass of its class in the same way, whose forward is the
  fused one (model.py);
- gives the inner model, and the model and base model around it, an `_init_weights`
  (their subclasses' too) that initialises the Norms as transformers initialises the norms
  they replaced, so init_weights, post_init and from_pretrained's missing keys work on a
  fused model built on the meta device. fuse runs inside `with torch.device("meta")`,
  where from_pretrained builds its models.
What fuse gives a model lives in these classes, not in the instances, so a fused model
copies and pickles whole: `torch.save(model)`, loaded back by the user with `weights_only` off,
gives a fused model (`_reduce_fused` names each class by the class it extends).
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as hf_init

from ...convert import norm_from
from ...modules.norm import Norm
from ...ops.checks import check_float_dtype
from .attn_res import ATTN_RES
from .check import refusals
from .families import FAMILIES, SUPPORTED, WRAPPED, WRAPPERS, Family, family_of_class
from .gated import GATED
from .refused import REFUSED
from .unit_sphere import UNIT_SPHERE
from .versions import check_version

# The roles of the modules fuse re-classes: a decoder layer (its shape's forward), the
# inner model (its family's model forward and the Norms' init) and the PreTrainedModels
# around it (the Norms' init)
LAYER, MODEL, INIT = "layer", "model", "init"
_FUSED_CLASSES: dict[tuple[type, Family | None, str], type] = {}


def _fused_class(cls: type, family: Family | None, role: str) -> type:
    """A subclass of cls with what fuse gives a module of `role` (LAYER, MODEL, INIT) as
    its methods, created once per class, family and role. Methods of the class rather
    than of the instance, so a copy or a pickle of the model carries them. It keeps cls's
    name (transformers finds layers by class name, e.g. _no_split_modules), and being a
    subclass, transformers' GradientCheckpointingLayer wraps a layer's forward for
    checkpointing as it does cls's. Pickled, an instance names cls, family and role
    (`_reduce_fused`): the class is made again where it is loaded."""
    if getattr(cls, "_fuseblock_fused", False):
        return cls
    key = (cls, family, role)
    if key not in _FUSED_CLASSES:
        if role == LAYER:
            methods = {"forward": family.shape.forward, "fuseblock_family": family}
            what = (f"on the fused residual stream ({family.shape.name}): forward(p, r, **kwargs) -> (sum, p', r')"
                    if family.model_forward is not None else
                    f"with its {family.shape.name} fused, called as {cls.__name__}")
        elif role == MODEL:
            methods, what = {"forward": family.model_forward, "_init_weights": _init_weights}, "with its fused forward"
        else:
            methods, what = {"_init_weights": _init_weights}, "holding a fused model"
        # A model class keeps its module too: transformers initialises a class from outside
        # its package as custom code (PreTrainedModel.is_custom_code), skipping modules whose
        # parameters it takes as loaded, GPT-2's scaled c_proj init among them
        _FUSED_CLASSES[key] = type(cls.__name__, (cls,), {
            **methods, "_fuseblock_fused": True, "_fuseblock_key": key, "__reduce_ex__": _reduce_fused,
            "__module__": __name__ if role == LAYER else cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} {what}; see fuseblock.integrations.transformers."})
    return _FUSED_CLASSES[key]


def _reduce_fused(self, protocol):
    """Pickling (and copying) an instance of a `_fused_class`: made again by
    `fused_instance` from the class's key, then given its state as any nn.Module."""
    return fused_instance, self._fuseblock_key, self.__getstate__()


def fused_instance(cls: type, family: Family | None, role: str) -> nn.Module:
    """An empty instance of `_fused_class(cls, family, role)`, which unpickling fills."""
    return object.__new__(_fused_class(cls, family, role))


def _is_rms_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def _convert_norms(base: nn.Module, family: Family) -> None:
    """The stream norms of family (found by role: RMSNorms and LayerNorms, with or without
    parameters, whatever their class; check.py has converted each before), and every
    RMSNorm inside the layers (Qwen3's q_norm / k_norm; LayerNorms there, StableLM's per-head
    ones, stay as they are), become fuseblock
    Norms with the same parameters; a module reachable under several names stays one
    module. A norm transformers has initialised (the flag its init_weights sets, and skips
    a module by) stays marked so: a later init_weights or post_init leaves it alone, as it
    would the original."""
    stream = {id(getattr(layer, family.parts[r])) for layer in getattr(base, family.model_parts["layers"])
              for r in family.norms}
    stream.add(id(getattr(base, family.model_parts["norm"])))
    # (the n-stream families: the stream's norms only; the hc modules' unweighted norms are
    # the hc ops' own, and the attention's norms stay as their modeling code computes them)
    inner = family.hyper is None
    converted: dict[int, Norm] = {}
    for parent in list(base.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in stream or (id(child) in converted) or (inner and _is_rms_norm(child)):
                if id(child) not in converted:
                    norm = converted[id(child)] = norm_from(child)
                    if getattr(child, "_is_hf_initialized", False):
                        norm._is_hf_initialized = True
                setattr(parent, name, converted[id(child)])


def _init_weights(self: PreTrainedModel, module: nn.Module) -> None:
    """`_init_weights` of each PreTrainedModel of a fused model: a method of the classes fuse
    gives them (`_fused_class`).

    transformers initialises weights through this one method: init_weights and post_init,
    and the keys from_pretrained finds missing (all of them on a model built on the meta
    device and moved with to_empty). It recognises a norm by its class name (*RMSNorm,
    *LayerNorm), which a fuseblock Norm does not carry, so the class's method would leave
    a Norm as it finds it: uninitialised memory. A Norm gets the initial values of the
    function it computes, which are what transformers gives the norm it replaced: the
    identity map, weight ones, or zeros where the weight has an offset (Gemma's 1 + w, which
    Gemma's _init_weights zeroes); bias zeros (Norm.reset_parameters' values). Through
    transformers' init functions, which leave a tensor flagged as loaded alone. Every other
    module goes to the method of the class fuse extended."""
    if not isinstance(module, Norm):
        self._fuseblock_key[0]._init_weights(self, module)
        return
    if module.weight is not None:
        (hf_init.zeros_ if module.weight_offset != 0.0 else hf_init.ones_)(module.weight)
    if module.bias is not None:
        hf_init.zeros_(module.bias)


def refusal(model_type: str) -> str:
    """Why fuse refuses a family it does not fuse (docs/transformers.md's table)."""
    return REFUSED.get(model_type, "not compared with fuseblock's stream shapes yet")


def language_model(model: PreTrainedModel) -> PreTrainedModel:
    """The inner model fuse puts on the fused stream: model's base model (LlamaModel and its
    kin), or in a multimodal wrapper (families.WRAPPERS: Llava, Gemma3, Mistral3, Qwen2-VL,
    Qwen2.5-VL) the language model inside it. A wrapper fuse has not checked (a base model
    holding a language_model) is a ValueError naming it."""
    base = model.base_model
    model_type = getattr(base.config, "model_type", None)
    if model_type in WRAPPERS:
        inner = getattr(base, WRAPPERS[model_type], None)
        if not isinstance(inner, PreTrainedModel):
            raise ValueError(f"fuse: {type(model).__name__} (model_type {model_type!r}) holds no language model in "
                             f"{WRAPPERS[model_type]!r}")
        return inner
    if model_type not in FAMILIES and isinstance(getattr(base, "language_model", None), nn.Module):
        why = REFUSED.get(model_type, "a multimodal wrapper fuse has not checked")
        raise ValueError(f"fuse: {type(model).__name__} (model_type {model_type!r}) is refused: {why}. fuse takes "
                         f"the language model of the wrappers {', '.join(WRAPPERS)}; docs/transformers.md lists them")
    return base


def family_of(model: PreTrainedModel) -> tuple[str, Family]:
    """model's family (config.model_type of its language model, `language_model`; else the
    fused family whose class its inner model is, `family_of_class`) and its entry, or a
    ValueError naming the family and why fuse refuses it: unknown, known and refused, or
    not what its entry says."""
    base = language_model(model)
    model_type = getattr(base.config, "model_type", None)
    family = FAMILIES.get(model_type) or WRAPPED.get(model_type)
    cls = type(base)
    if family is None and getattr(transformers, cls.__name__, None) is cls and family_of_class(cls.__name__):
        # a config-only family, or a model_type fuse does not know, on a fused family's class:
        # that family's entry, held to the model's structure as its own models are
        model_type = family_of_class(cls.__name__)
        family = FAMILIES[model_type]
    if family is None:
        raise ValueError(f"fuse: {type(model).__name__} (model_type {model_type!r}) is refused: {refusal(model_type)}. "
                         f"fuse takes {', '.join(SUPPORTED)}; docs/transformers.md lists every family")
    if family.variant is not None:  # a config flag picks the layout (use_parallel_residual)
        family = family.variant(base.config)
    found = refusals(base, family)
    if found:
        raise ValueError(f"fuse: {type(base).__name__} (model_type {base.config.model_type!r}) is not the layout fuse "
                         f"fuses as {model_type} ({family.shape.name}): {'; '.join(found)}")
    return model_type, family


def fuse(model: PreTrainedModel, *, residual_dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Put a transformers model on the fused residual stream, in place; returns it.

    model: a PreTrainedModel of a supported family (`SUPPORTED`, by config.model_type),
    the bare model (LlamaModel) or one with a head (LlamaForCausalLM, ...), or a
    multimodal wrapper (`WRAPPERS`: LlavaForConditionalGeneration, ...) of one, whose
    language model it fuses, leaving the vision tower and projector as they are. Its
    state_dict keys do not change: its save_pretrained output loads into the unfused class, and
    checkpoints of the unfused class load into it. A model whose structure differs from
    what its family's fused forward computes is a ValueError saying what differs.

    residual_dtype: the dtype of the residual stream. None (default) is what the unfused
    model's own adds give (torch's type promotion: under bf16 autocast with fp32
    parameters the stream is fp32 already); torch.float32 keeps an fp32 stream in a bf16
    model. Calling fuse again on a fused model only changes residual_dtype. The n-stream
    families (deepseek_v4, hy_v4, glm5_next) keep their streams in the model's dtype, and
    inkling2_loop its partial blocks in fp32, and dory its stream in the model's dtype, as
    their modeling code does: None only.

    A transformers version outside the tested range (versions.TESTED: 5.17 to 5.24) is a
    RuntimeError naming the range.
    """
    check_version()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    check_float_dtype("residual_dtype", residual_dtype)
    base = language_model(model)
    family = getattr(base, "fuseblock_family", None) or family_of(model)[1]
    if residual_dtype is not None and family.hyper is not None:
        raise ValueError(f"residual_dtype: {type(base).__name__}'s n residual streams are kept in the model's "
                         f"dtype, as its modeling code keeps them (residual_dtype=None)")
    if residual_dtype is not None and family.shape is ATTN_RES:
        raise ValueError(f"residual_dtype: {type(base).__name__}'s partial blocks are kept in fp32 and its block "
                         f"states in the model's dtype, as its modeling code keeps them (residual_dtype=None)")
    if residual_dtype is not None and family.shape is GATED:
        raise ValueError(f"residual_dtype: {type(base).__name__}'s stream is its gates' output, in the dtype its "
                         f"modeling code gives it (residual_dtype=None)")
    if residual_dtype is not None and family.shape is UNIT_SPHERE:
        raise ValueError(f"residual_dtype: {type(base).__name__}'s stream is kept in the model's dtype, as its "
                         f"modeling code keeps it (residual_dtype=None)")
    layers = getattr(base, "fuseblock_family", None) and getattr(base, base.fuseblock_family.model_parts["layers"])
    if layers is None:
        # (their norms stay the modeling code's: the ops read their weights, the unit sphere's their eps)
        if family.shape not in (ATTN_RES, GATED, UNIT_SPHERE):
            _convert_norms(base, family)
            # the model, its base model and a wrapper's language model each initialise their own
            # modules; a wrapper's vision tower holds no Norm and keeps its own method
            for module in {id(m): m for m in (model, model.base_model)}.values():
                if module is not base:
                    module.__class__ = _fused_class(type(module), None, INIT)
        layers = getattr(base, family.model_parts["layers"])
        for layer in layers:
            layer.__class__ = _fused_class(type(layer), family, LAYER)
        base.fuseblock_family = family
        if family.model_forward is not None:
            base.__class__ = _fused_class(type(base), family, MODEL)
    for layer in layers:
        layer.fuseblock_residual_dtype = residual_dtype
    base.fuseblock_residual_dtype = residual_dtype
    return model
