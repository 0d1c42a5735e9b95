"""The fused decoder-layer forwards, one per stream shape (docs/stream.md).

Each is bound as the forward of a subclass of the family's decoder-layer class
(fuse.py), and takes and returns the stream in pieces rather than summed:

    forward(p, r, **kwargs) -> (sum, p', r')

p is the previous layer's last branch output, not yet added (the embeddings, with r None,
at the first layer), r the residual stream; kwargs (masks, rotary embeddings, cache, ...)
go to the attention as in the unfused layer. A layer finds its modules by role through
its family (`self.fuseblock_family.parts`), so one forward serves every family of a shape
whatever it names its modules.

The add that takes p into the stream is the next layer's (or the model's final norm's),
where it meets a norm: `Shape.enter`. It reads the branch's scale and dropout off the
layer that receives p: the check before fusing (check.py) requires every layer to carry
the same ones. A layer uses its own parameters only, never its neighbour's: FSDP
gathers a layer's parameters for that layer's forward alone, and checkpointing recomputes
one layer at a time. So a sandwich layer applies its MLP's post-norm itself: it and the
next layer's input norm belong to two layers.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from ...hyper_spec import FORMS, HyperSpec, Mode
from ...ops.hyper import hc_add_norm, hc_norm
from ...reference import hyper as hyper_reference

# The private keyword the fused model forward gives its layers when hidden states are
# recorded: the layer then also returns its unfused output, p + r
SUM = "fuseblock_hidden_state"


def module(layer: nn.Module, role: str) -> nn.Module:
    """The layer's module that plays `role` in its family (families.Family.parts)."""
    return getattr(layer, layer.fuseblock_family.parts[role])


def branch(layer: nn.Module, role: str) -> dict:
    """add_norm's branch keywords for the residual add of `layer`'s `role` branch ("attn" or
    "mlp"): alpha where the family scales its branches, dropout_p where it drops them and the
    layer is training. Empty for a plain add, so add_norm takes its plain lane."""
    family, kw = layer.fuseblock_family, {}
    if family.alpha is not None:
        kw["alpha"] = float(getattr(layer, family.alpha))
    if family.dropout is not None and layer.training and role in family.dropout:  # (StableLM drops its MLP's alone)
        p = getattr(layer, family.dropout[role]).p
        if p:
            kw["dropout_p"] = p
    return kw


def _plain_branch(layer: nn.Module, role: str) -> float | None:
    """The alpha of `layer`'s `role` branch (None: 1), for recording the unfused sum r + b(p).
    A dropped branch's sum needs the mask the fused op drew inside its kernel: recording
    hidden states while training with residual dropout is refused rather than recorded
    with another mask."""
    kw = branch(layer, role)
    if "dropout_p" in kw:
        raise ValueError(f"{type(layer).__name__}: output_hidden_states while training with residual dropout is "
                         f"not supported on the fused stream (the recorded sums would take other masks); "
                         f"record them in eval mode or with the dropout at 0")
    return kw.get("alpha")


# ------------------------------------------------------------------------- pre-norm


def _enter(layer, hidden: Tensor, residual: Tensor | None, norm, rdtype):
    """norm(r + b(p)) and r + b(p) in one add_norm, b the branch of `layer` (alpha, dropout);
    the embeddings (residual None) enter as they are."""
    if residual is None:
        return norm.add(hidden, None, residual_dtype=rdtype)
    return norm.add(hidden, residual, residual_dtype=rdtype, **branch(layer, "mlp"))


def _total(layer, hidden: Tensor, residual: Tensor) -> Tensor:
    """The unfused layer's output r + alpha * p, as the unfused layer computes it."""
    alpha = _plain_branch(layer, "mlp")
    return residual + (hidden if alpha is None else hidden * alpha)


def _pre_norm(self, hidden_states: Tensor, residual: Tensor | None = None, **kwargs):
    """Llama and its kin: r' = r + b(attn(N1(r))), r'' = r' + b(mlp(N2(r'))), each add
    with the norm after it; b is the family's branch (alpha * drop, see branch())."""
    want_sum, rdtype = kwargs.pop(SUM, False), self.fuseblock_residual_dtype
    normed, residual = _enter(self, hidden_states, residual, module(self, "norm_1"), rdtype)
    attn = module(self, "attn")(hidden_states=normed, **kwargs)[0]
    normed, residual = module(self, "norm_2").add(attn, residual, residual_dtype=rdtype, **branch(self, "attn"))
    hidden = self.fuseblock_family.mlp_output(module(self, "mlp")(normed))
    return (_total(self, hidden, residual) if want_sum else None), hidden, residual


# ------------------------------------------------------------------------- sandwich


def _sandwich(self, hidden_states: Tensor, residual: Tensor | None = None, **kwargs):
    """Gemma2 and its kin (Peri-LN): each branch output is normalized before its add. The
    attention's post-norm, add and the MLP's pre-norm are one norm_add_norm; the MLP's
    post-norm is applied here (the norm after its add is the next layer's, see the module
    docstring), its add meeting the next input norm in one add_norm."""
    want_sum, rdtype = kwargs.pop(SUM, False), self.fuseblock_residual_dtype
    normed, residual = _enter(self, hidden_states, residual, module(self, "norm_1"), rdtype)
    attn = module(self, "attn")(hidden_states=normed, **kwargs)[0]
    normed, residual = module(self, "post_attn").norm_add_norm(attn, residual, module(self, "norm_2"),
                                                                residual_dtype=rdtype, **branch(self, "attn"))
    hidden = module(self, "post_mlp")(module(self, "mlp")(normed))
    return (_total(self, hidden, residual) if want_sum else None), hidden, residual


class Shape(NamedTuple):
    """A stream shape as fuse applies it: its name (docs/stream.md's), the fused layer
    forward, `enter(layer, p, r, norm, rdtype) -> (norm(r'), r')` (the add that takes a
    layer's output p into the stream at `norm`, with `layer`'s branch; the model's final
    norm calls it with the last layer), and the roles the forward reads
    (families.Family.parts holds them). A shape whose stream holds more than (p, r) (the
    parallel one's p1) takes and returns the rest after r, positionally, and its enter
    takes it after rdtype. The n-stream shape has no enter: its model forward ends in
    the hyper-connection head (model.hyper_forward)."""
    name: str
    forward: Callable
    enter: Callable
    roles: frozenset


PRE_NORM = Shape("pre-norm", _pre_norm, _enter, frozenset({"norm_1", "attn", "norm_2", "mlp"}))
SANDWICH = Shape("sandwich", _sandwich, _enter, frozenset({"norm_1", "attn", "post_attn", "norm_2", "mlp", "post_mlp"}))


# ------------------------------------------------------------------------- parallel


def _shared_dropout(layer) -> bool:
    """Whether the two branches drop with one probability (or neither drops), which the
    add applies: one add_norm draws x's and x1's masks with one dropout_p. Where they
    differ (StableLM drops its MLP's output alone) the layer applies its own dropout
    modules to its outputs, exactly as the unfused layer does, and the add drops nothing."""
    family = layer.fuseblock_family
    drops = family.dropout or {}
    return len({getattr(layer, drops[r]).p if r in drops else 0.0 for r in ("attn", "mlp")}) == 1


def _parallel_branch(layer) -> dict:
    """add_norm's branch keywords for the add of `layer`'s two branch outputs."""
    kw = branch(layer, "mlp")
    if not _shared_dropout(layer):
        kw.pop("dropout_p", None)
    return kw


def _enter_parallel(layer, hidden: Tensor, residual: Tensor | None, norm, rdtype, hidden_1: Tensor | None = None):
    """norm(r') and r' = r + b(p) + b(p1) in one add_norm (x = p, x1 = p1), which sums them
    as (p + p1) + r on the torch path: GPT-NeoX's mlp + attn + r and Phi's attn + mlp + r
    (a + b = b + a in floating point, so both are bitwise); the embeddings (residual None)
    enter as they are."""
    if residual is None:
        return norm.add(hidden, None, residual_dtype=rdtype)
    return norm.add(hidden, residual, residual_dtype=rdtype, x1=hidden_1, **_parallel_branch(layer))


def _enter_parallel_residual_first(layer, hidden: Tensor, residual: Tensor | None, norm, rdtype,
                                   hidden_1: Tensor | None = None):
    """As _enter_parallel for families that sum (r + attn) + mlp (Cohere, StableLM): r goes
    in add_norm's x slot and p (the MLP's output) in its residual slot, so the torch path's
    (x + x1) + residual is that order, bitwise. Only for a plain add of one dtype: x is what
    the branch scale and dropout apply to, and x1 takes x's dtype (an fp32 stream of bf16
    branches takes _enter_parallel's order, as no unfused sum has its dtypes)."""
    if residual is None:
        return norm.add(hidden, None, residual_dtype=rdtype)
    kw = _parallel_branch(layer)
    if kw or residual.dtype != hidden_1.dtype:
        return norm.add(hidden, residual, residual_dtype=rdtype, x1=hidden_1, **kw)
    return norm.add(residual, hidden, residual_dtype=rdtype, x1=hidden_1)


def _parallel(self, hidden_states: Tensor, residual: Tensor | None = None, hidden_1: Tensor | None = None,
              **kwargs):
    """GPT-NeoX (use_parallel_residual), Phi, Cohere, StableLM (use_parallel_residual): both
    branches read the same stream, r' = r + b(attn(N1(r))) + b(mlp(N2(r))), N2 the layer's
    "norm_2" where it has one (GPT-NeoX), else N2 = N1 (one normed input feeds both). The
    two outputs go on un-added: the stream is (p, r, p1), p the MLP's output and p1 the
    attention's, and the next layer's input norm (or the final norm) adds both in its
    add_norm (the shape's enter). So a layer is one add_norm with x1, plus GPT-NeoX's
    second norm of r, where the unfused layer is two norms and two adds."""
    want_sum, rdtype = kwargs.pop(SUM, False), self.fuseblock_residual_dtype
    enter = self.fuseblock_family.shape.enter
    normed, residual = enter(self, hidden_states, residual, module(self, "norm_1"), rdtype, hidden_1)
    attn = module(self, "attn")(hidden_states=normed, **kwargs)[0]
    if "norm_2" in self.fuseblock_family.parts:  # in the activations' dtype, as norm_1's (an fp32 stream's is fp32)
        normed = module(self, "norm_2")(residual).to(normed.dtype)
    hidden = module(self, "mlp")(normed)
    drops = self.fuseblock_family.dropout
    if drops and self.training and not _shared_dropout(self):  # the add cannot drop them: the layer's own modules do
        attn = getattr(self, drops["attn"])(attn) if "attn" in drops else attn
        hidden = getattr(self, drops["mlp"])(hidden) if "mlp" in drops else hidden
    return (_parallel_total(self, hidden, residual, attn) if want_sum else None), hidden, residual, attn


def _parallel_total(layer, hidden: Tensor, residual: Tensor, hidden_1: Tensor) -> Tensor:
    """The unfused layer's output, its three terms summed in the order its shape's enter
    sums them (a dropout in the add is refused by _plain_branch: its masks are the op's)."""
    alpha = _plain_branch(layer, "mlp") if _shared_dropout(layer) else branch(layer, "mlp").get("alpha")
    if alpha is not None:
        return residual + (hidden + hidden_1) * alpha
    if layer.fuseblock_family.shape.enter is _enter_parallel_residual_first and residual.dtype == hidden_1.dtype:
        return residual + hidden_1 + hidden
    return hidden + hidden_1 + residual


_PARALLEL_ROLES = frozenset({"norm_1", "attn", "mlp"})
PARALLEL = Shape("parallel", _parallel, _enter_parallel, _PARALLEL_ROLES)
PARALLEL_RESIDUAL_FIRST = Shape("parallel", _parallel, _enter_parallel_residual_first, _PARALLEL_ROLES)
# ------------------------------------------------------------------------- post-norm


def _activations(layer, stream: Tensor) -> Tensor:
    """What a post-norm layer's sublayers read: the stream itself, in the dtype of the
    layer's weights where residual_dtype keeps the stream wider (a bf16 model with an fp32
    stream feeds its attention, MLP and head bf16, as the unfused bf16 model does)."""
    if layer.fuseblock_residual_dtype is None:
        return stream
    return stream.to(next(module(layer, "attn").parameters()).dtype)


def _post_norm(self, hidden_states: Tensor, residual: Tensor | None = None, **kwargs):
    """OLMo2 and its kin: no pre-norm; r' = r + b(N_a(attn(r))), r'' = r' + b(N_m(mlp(r'))),
    each norm and its add one norm_add. Every add completes in its own layer, so no branch
    output is carried: the layer takes the whole stream as p (r None, as the embeddings
    enter the first layer) and returns (r'', r'', None) or (None, r'', None); the model's
    final norm is then a plain norm of p (`_post_enter`)."""
    if residual is not None:
        raise ValueError(f"{type(self).__name__}: a post-norm layer takes the whole stream as its first argument, "
                         f"and no residual")
    want_sum, rdtype = kwargs.pop(SUM, False), self.fuseblock_residual_dtype
    attn = module(self, "attn")(hidden_states=_activations(self, hidden_states), **kwargs)[0]
    stream = module(self, "post_attn").norm_add(attn, hidden_states, residual_dtype=rdtype, **branch(self, "attn"))
    hidden = module(self, "mlp")(_activations(self, stream))
    stream = module(self, "post_mlp").norm_add(hidden, stream, residual_dtype=rdtype, **branch(self, "mlp"))
    return (stream if want_sum else None), stream, None


def _post_enter(layer, hidden: Tensor, residual: Tensor | None, norm, rdtype):
    """The final norm after a post-norm layer: the whole stream is p (residual None), so a
    plain norm of it, in the activations' dtype (`_activations`)."""
    normed, stream = norm.add(hidden, residual, residual_dtype=rdtype)
    return _activations(layer, normed), stream


POST_NORM = Shape("post-norm", _post_norm, _post_enter, frozenset({"attn", "post_attn", "mlp", "post_mlp"}))


# ------------------------------------------------------------------------- n streams (mHC)


class Hyper(NamedTuple):
    """What an n-stream (hyper-connection) family's fused forwards need beyond its modules
    (families.py holds one per family; their layers call attention and MLP differently).

    form: whose order of operations the hc ops' torch path follows (fuseblock.reference.hyper),
        the family's modeling code's, so that fp32 is bitwise.
    options: the layer's hyper-connection module -> the hc ops' keywords it fixes (iters,
        hc_eps, post_mult, post_eps), read off the module as its forward reads them.
    attend: (layer, normed, **kwargs) -> (the attention's output, the top-k indices its
        indexer hands the next layer, or None).
    feed: (layer, normed, kwargs) -> the MLP's output.
    inputs: (inner model, input_ids, inputs_embeds, attention_mask, position_ids,
        cache, use_cache) -> each layer's keywords, as the unfused model forward
        builds them (masks, rotary embeddings, cache).
    topk: whether a layer takes the previous layer's top-k (prev_topk_indices).
    weighted_head: the head collapses with its own pre (hc_fn, hc_base, hc_scale), else the
        streams' mean (GLM-5-next).
    """
    form: str
    options: Callable
    attend: Callable
    feed: Callable
    inputs: Callable
    topk: bool
    weighted_head: bool


def _boundary(layer, hc_role: str, norm_role: str, streams: Tensor, branch: Tensor | None, post, comb):
    """One boundary in one hc op: the last sublayer's update (none before the first layer),
    the coefficients of `hc_role`'s module, the collapse and `norm_role`'s norm.
    Returns (normed, streams, post, comb)."""
    hc, norm, hyper = module(layer, hc_role), module(layer, norm_role), layer.fuseblock_family.hyper
    kw = dict(hyper.options(hc), eps=norm.eps, form=hyper.form)
    if branch is None:
        normed, post, comb = hc_norm(streams, hc.fn, hc.base, hc.scale, norm.weight, **kw)
        return normed, streams, post, comb
    return hc_add_norm(streams, branch, post, comb, hc.fn, hc.base, hc.scale, norm.weight, **kw)


def _hyper_total(layer, streams: Tensor, branch: Tensor, post: Tensor, comb: Tensor | None) -> Tensor:
    """The unfused layer's output post (x) f + comb^T H, in its modeling code's order (for
    recording hidden states; the fused stream leaves it to the next boundary)."""
    n, d = streams.shape[-2:]
    # hyper_reference.update reads the spec's form alone; the rest describes a boundary it does not run
    spec = HyperSpec(n, d, Mode.PRE_POST_COMB, update=True, comb_in=comb is not None, iters=1, hc_eps=0.0, eps=1.0,
                     post_mult=1.0, post_eps=0.0, form=FORMS[layer.fuseblock_family.hyper.form])
    return hyper_reference.update(streams, branch, post, comb, spec)


def _hyper(self, streams: Tensor, branch: Tensor | None = None, post: Tensor | None = None,
           comb: Tensor | None = None, **kwargs):
    """DeepSeek-V4, HY-V4, GLM-5-next: n residual streams H (..., n, d). The unfused layer is

        (post_a, comb_a, x) = attn_hc(H);  H1 = post_a (x) attn(N1(x)) + comb_a^T H
        (post_m, comb_m, x) = ffn_hc(H1);  H2 = post_m (x) mlp(N2(x)) + comb_m^T H1

    Fused, each update meets the next sublayer's coefficients, collapse and norm in one hc
    op: the layer takes the previous layer's (H, f, post, comb) with its MLP update not
    yet done (H alone at the first layer) and returns its own, with the top-k indices of
    its attention's indexer: (sum, H1, f, post_m, comb_m, topk). The model forward's head
    does the last update (model.hyper_forward)."""
    want_sum = kwargs.pop(SUM, False)
    hyper = self.fuseblock_family.hyper
    normed, streams, post, comb = _boundary(self, "hc_1", "norm_1", streams, branch, post, comb)
    attn, topk = hyper.attend(self, normed, **kwargs)
    normed, streams, post, comb = _boundary(self, "hc_2", "norm_2", streams, attn, post, comb)
    hidden = hyper.feed(self, normed, kwargs)
    total = _hyper_total(self, streams, hidden, post, comb) if want_sum else None
    return total, streams, hidden, post, comb, topk


HYPER = Shape("n-stream (mHC)", _hyper, None, frozenset({"hc_1", "norm_1", "attn", "hc_2", "norm_2", "mlp"}))
