"""The fused pre-norm residual stream (docs/stream.md).

Naive pre-norm stack:  x_k = x_{k-1} + f_k(norm_k(x_{k-1})),  o = x_n  (or norm_f(x_n)).
Fused stack, carrying (p_k, r_k):

    p_0 = x, r_0 = 0
    r_k = p_{k-1} + r_{k-1}      } one add_norm launch per sublayer
    q_k = norm_k(r_k)            }
    p_k = f_k(q_k)
    o   = p_n + r_n              (or norm_f(p_n + r_n): one more add_norm)

Claim: r_k = x_{k-1} for k = 1..n+1. r_1 = x + 0 = x_0; if r_k = x_{k-1} then
p_k = f_k(norm_k(x_{k-1})) and r_{k+1} = p_k + r_k = x_k. So o = p_n + r_n = x_n.
Backward: r_k feeds both norm_k and r_{k+1}, so the gradient arriving at r_k from
later sublayers adds to the one through the norm, and the sum is the gradient of both
summands p_{k-1} and r_{k-1} (docs/stream.md: dx = dx + dr, done in the backward kernel).
docs/stream.md has the long form.
"""
from __future__ import annotations

import inspect
import numbers
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from .convert import norm_from
from .modules.norm import AddNorm, Norm
from .ops.checks import check_flag, check_float_dtype, check_int, check_number


def split_output(out) -> tuple:
    """(new hidden state, extras) of a mixer's output: a tuple `(out, *rest)` (Hugging Face
    attention returns (out, weights)) gives (out, rest), a tensor gives (out, ())."""
    return (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())


def check_mixer_output(i: int, mixer: nn.Module, out, x: Tensor, what: str = "mixers") -> None:
    """That `what`[i]'s output is a tensor of x's shape: unchecked, a wrong width reaches the
    next norm, which refuses it as x's last dim (every stack's naive twin checks it so)."""
    if not isinstance(out, Tensor):
        raise TypeError(f"{what}[{i}] ({type(mixer).__name__}) returned "
                        f"{type(out).__name__}, not a tensor (or a tuple whose first element is one)")
    if out.shape != x.shape:
        raise ValueError(f"{what}[{i}] ({type(mixer).__name__}) maps last dim {x.shape[-1]} "
                         f"to {out.shape[-1]} (shape {tuple(x.shape)} to {tuple(out.shape)}): every mixer "
                         f"must map (..., {x.shape[-1]}) to the same shape")


def route_keywords(kwargs: dict, blocks, accepted, owner: str) -> list[dict]:
    """Each block's keyword arguments: those its mixer's forward accepts (`accepted(block)`:
    a set of names, or None for any). A keyword no block takes is a TypeError naming it."""
    if not kwargs:
        return [kwargs] * len(blocks)
    routed, used = [], set()
    for block in blocks:
        names = accepted(block)
        mine = kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}
        used.update(mine)
        routed.append(mine)
    unused = [k for k in kwargs if k not in used]
    if unused:
        raise TypeError(f"{owner}.forward got keyword argument(s) {', '.join(map(repr, unused))} "
                        f"that no mixer's forward accepts")
    return routed


def keywords_accepted(mixer: nn.Module, bound: int, reserved: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The keywords `mixer.forward` accepts once the block has bound its first `bound`
    parameters positionally and passed `reserved` itself; None for all: a **kwargs (as a
    torch.compile'd module's forward has), or a forward whose signature cannot be read."""
    try:
        params = list(inspect.signature(mixer.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: pass everything, as before
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = {p.name for p in positional[:bound]} | set(reserved)
    return frozenset(p.name for p in params
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in taken)


def _positional_room(mixer: nn.Module) -> float:
    """How many positional arguments `mixer.forward` takes after its input (inf for *args,
    or a forward whose signature cannot be read)."""
    try:
        params = list(inspect.signature(mixer.forward).parameters.values())
    except (TypeError, ValueError):
        return float("inf")
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return float("inf")
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) - 1


def _check_variant(alpha, dropout, parallel, sandwich: bool, post_norm: bool) -> None:
    """The block options, and the combinations the fused ops take (docs/stream.md)."""
    check_number("alpha", alpha)
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    check_flag("sandwich", sandwich)
    check_flag("post_norm", post_norm)
    if parallel is not None and not isinstance(parallel, nn.Module):
        raise TypeError(f"parallel must be an nn.Module (the second mixer) or None, got {type(parallel).__name__}")
    # norm_add and norm_add_norm take no second branch and no dropout
    unsupported = [name for name, on in (("sandwich", sandwich), ("post_norm", post_norm),
                                         ("parallel", parallel is not None), ("dropout", dropout > 0)) if on]
    if (sandwich or post_norm) and len(unsupported) > 1:
        raise ValueError(f"{' with '.join(unsupported)} is not supported: sandwich and post_norm fuse one branch "
                         f"without dropout (norm_add_norm, norm_add); use one of them alone (alpha goes with any)")


def _dropped(t: Tensor, p: float) -> Tensor:
    return F.dropout(t, p, training=True) if p > 0.0 else t


def _scaled(alpha, t: Tensor) -> Tensor:
    """alpha * t: alpha a float (1: t itself) or a [d] tensor."""
    if isinstance(alpha, Tensor):
        return t * alpha
    return t if alpha == 1.0 else alpha * t


def _check_scale(name: str, value, dim: int):
    """A block's residual_scale or branch_scale: a finite float, or a (dim,) float tensor
    (an nn.Parameter to learn it: nGPT's, Muse Spark's per-channel gates)."""
    if isinstance(value, Tensor):
        if value.shape != (dim,) or not value.is_floating_point():
            raise ValueError(f"{name} must be a float or a ({dim},) float tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        return value
    check_number(name, value)
    return float(value)


class PreNormBlock(nn.Module):
    """One pre-norm sublayer: `forward(hidden, residual=None, *args, **kwargs) -> (hidden, residual)`.

    residual' = residual + alpha * drop(hidden), hidden' = mixer(norm(residual'), *args,
    **kwargs), the add and the norm in one launch (with no residual, the stream's input:
    residual' = hidden as it is). `mixer` is any module mapping (..., dim) to (..., dim);
    the extra arguments (rotary embeddings, masks, caches, position ids) go to it
    unchanged. A mixer that returns a tuple `(out, *rest)` (Hugging Face attention returns
    (out, weights)) makes the block return `(out, residual, *rest)`: the first element is
    the new hidden state, the rest follow the residual untouched.

    `norm` is an AddNorm (a Norm): the residual is kept in residual_dtype, by default the
    dtype of torch's `hidden + residual`. kind, eps, bias and weight_offset are Norm's
    (bias=None: a bias for kind="layer" only; eps=None: torch's default for the kind and the residual's dtype).

    The shapes of docs/stream.md, each the naive twin's `naive(x)` step:
    - `alpha` (a float) scales the branch and `dropout` (a probability, applied in training
      only) drops from it: x + alpha * drop(mixer(N(x))). The block applies them to the
      branch it adds, `hidden`, so in a chain they are the previous block's output's.
    - `parallel=module`: one norm feeds two mixers whose outputs add (GPT-J, Phi):
      x + alpha * (drop(mixer(h)) + drop(parallel(h))), h = N(x). With `parallel_norm`
      (True: a Norm of the block's settings; or an existing norm module) the parallel
      module reads its own norm of the same x, N_2(x) (GPT-NeoX's two input norms). forward returns the pair
      `(out, out1)` as the hidden state, which the next block (or the stack's final norm)
      adds with add_norm's x1; each module gets the keywords its forward accepts.
    - `sandwich=True` (Gemma2's Peri-LN): a branch norm `branch_norm` on the mixer's
      output, x + alpha * N_b(mixer(N(x))). forward returns the output before N_b; the next
      block takes `branch_norm=` this block's branch_norm and applies N_b, the add and its
      own norm in one launch (norm_add_norm), as ResidualStack does.
    - `post_norm=True` (OLMo2): no pre-norm, x + alpha * N_b(mixer(x)); `norm` is None and
      forward takes the whole stream as `hidden` (residual None) and returns
      `(new stream, None, *rest)`, one norm_add launch.
    sandwich and post_norm take no dropout or parallel, and not each other (ValueError).

    A mixer with `fuses_prenorm = True` is called as `mixer(hidden, residual, *args,
    prenorm=norm, **kwargs) -> (hidden', residual')` instead: it applies `norm` itself,
    fused into its first Linear (fuseblock.norm_linear), so the normed activations are not
    kept for backward. The call goes through the mixer's __call__, so its hooks (FSDP2's
    gathering of its parameters among them) run as for any call. The naive form still
    calls `mixer(norm(x))`. norm_linear takes none of the options above: such a mixer in a
    block with one is a ValueError.
    """

    def __init__(
        self,
        mixer: nn.Module,
        dim: int | None = None,
        *,
        norm: nn.Module | None = None,
        kind: str = "rms",
        eps: float | None = None,
        residual_dtype: torch.dtype | None = None,
        bias: bool | None = None,
        weight_offset: float = 0.0,
        alpha: float = 1.0,
        dropout: float = 0.0,
        parallel: nn.Module | None = None,
        parallel_norm: bool | nn.Module = False,
        sandwich: bool = False,
        post_norm: bool = False,
        residual_scale: float | Tensor = 1.0,
        branch_scale: float | Tensor | None = None,
    ):
        super().__init__()
        if not isinstance(mixer, nn.Module):
            raise TypeError(f"mixer must be an nn.Module, got {type(mixer).__name__}")
        _check_variant(alpha, dropout, parallel, sandwich, post_norm)
        if post_norm and residual_dtype is not None:
            raise ValueError("post_norm with residual_dtype is not supported: each mixer reads the stream itself, "
                             "so the stream keeps the activations' dtype")
        self.mixer = mixer
        norm_kw = dict(kind=kind, eps=eps, bias=bias, weight_offset=weight_offset)
        if norm is not None:
            existing, dim, norm_kw = self._existing_norm(norm, dim, post_norm, norm_kw)
        check_int("dim", dim)
        meta = {} if norm is None else dict(device="meta")  # its parameters are replaced next
        self.norm = None if post_norm else AddNorm(dim, residual_dtype=residual_dtype, **norm_kw, **meta)
        if norm is not None:  # the existing norm's own Parameter objects, not copies
            self.norm.weight, self.norm.bias = existing.weight, existing.bias
        self.parallel = parallel
        self.parallel_norm = self._second_norm(parallel_norm, parallel, dim, norm_kw)
        self.branch_norm = Norm(dim, **norm_kw) if sandwich or post_norm else None
        self.sandwich, self.post_norm = sandwich, post_norm
        if branch_scale is not None and not isinstance(branch_scale, Tensor):  # alpha's other name
            if alpha != 1.0:
                raise ValueError("alpha and branch_scale are one scale (alpha is branch_scale's float form): give one")
            alpha, branch_scale = branch_scale, None
        self.alpha, self.dropout = alpha, dropout
        # the per-channel scales: a float, or a [d] tensor kept as given (an nn.Parameter is
        # learned, any other tensor a buffer)
        for name, value in (("residual_scale", residual_scale), ("branch_scale", branch_scale)):
            value = value if value is None else _check_scale(name, value, dim)
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                self.register_buffer(name, value)
            else:
                setattr(self, name, value)
        self._keywords_cache = [(None, None), (None, None)]  # (module, its keywords) of the mixer, the parallel
        self._room_cache = [(None, None), (None, None)]  # (module, how many side inputs it takes) of the two
        self._keywords(None)

    @staticmethod
    def _second_norm(parallel_norm, parallel, dim: int, norm_kw: dict) -> Norm | None:
        """The parallel module's own norm (GPT-NeoX's two input norms): None for False, a
        Norm with the block's settings for True, an existing norm read by norm_from (its
        own Parameters) for a module."""
        if parallel_norm is False:
            return None
        if parallel is None:
            raise ValueError("parallel_norm is the parallel module's norm: it needs parallel=")
        if parallel_norm is True:
            return Norm(dim, **norm_kw)
        if not isinstance(parallel_norm, nn.Module):
            raise TypeError(f"parallel_norm must be a bool or an nn.Module (an existing norm), got "
                            f"{type(parallel_norm).__name__}")
        second = norm_from(parallel_norm)
        if second.dim != dim:
            raise ValueError(f"parallel_norm normalizes {second.dim}, the block {dim}")
        return second

    @staticmethod
    def _existing_norm(norm: nn.Module, dim, post_norm: bool, norm_kw: dict):
        """(its Norm by norm_from, dim, the Norm keywords) for `norm=`: the module's kind,
        eps, bias and weight offset, which the block's own keywords must then leave alone."""
        if not isinstance(norm, nn.Module):
            raise TypeError(f"norm must be an nn.Module (an existing norm) or None, got {type(norm).__name__}")
        if post_norm:
            raise ValueError("norm= with post_norm is not supported: a post-norm block has no pre-norm")
        given = [k for k, v in norm_kw.items() if v != dict(kind="rms", eps=None, bias=None, weight_offset=0.0)[k]]
        if given:
            raise ValueError(f"norm= carries its own kind, eps, bias and weight_offset: pass {', '.join(given)} "
                             f"or norm=, not both")
        existing = norm_from(norm)  # a TypeError naming the module where it is no norm fuseblock computes
        if dim is not None and dim != existing.dim:
            raise ValueError(f"dim is {dim} but norm= normalizes {existing.dim}")
        kw = dict(kind=existing.kind, eps=existing.eps, bias=existing.bias is not None,
                  weight_offset=existing.weight_offset)
        return existing, existing.dim, kw if existing.weight is not None else dict(kw, elementwise_affine=False)

    @property
    def residual_dtype(self) -> torch.dtype | None:
        return None if self.norm is None else self.norm.residual_dtype

    # alpha and dropout may be set on a built block, checked as the constructor checks them
    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        _check_variant(value, getattr(self, "_dropout", 0.0), self.parallel, self.sandwich, self.post_norm)
        self._alpha = float(value)

    @property
    def dropout(self) -> float:
        return self._dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        _check_variant(getattr(self, "_alpha", 1.0), value, self.parallel, self.sandwich, self.post_norm)
        self._dropout = float(value)

    def _scales(self) -> dict:
        """The per-channel scales as add_norm's keywords, {} where there are none."""
        rs, bs = self.residual_scale, self.branch_scale
        if bs is None and not isinstance(rs, Tensor) and rs == 1.0:
            return {}
        return dict(residual_scale=rs, branch_scale=bs)

    def _has_options(self) -> bool:
        return (self.alpha != 1.0 or self.dropout > 0.0 or self.parallel is not None or self.sandwich
                or self.post_norm or bool(self._scales()))

    def forward(self, hidden, residual: Tensor | None = None, *args, branch_norm: Norm | None = None,
                **kwargs) -> tuple:
        # A mixer whose first op is a Linear on the normed input may take the norm in
        # with it (fuseblock.norm_linear, docs/stream.md): it is handed the un-normed sum.
        if getattr(self.mixer, "fuses_prenorm", False):
            if self._has_options() or branch_norm is not None:
                raise ValueError(f"a fuses_prenorm mixer ({type(self.mixer).__name__}) fuses the norm into its "
                                 f"Linear, which takes no alpha, dropout, parallel, sandwich, post_norm or "
                                 f"residual_scale/branch_scale")
            return self.mixer(hidden, residual, *args, prenorm=self.norm, **kwargs)
        hidden, residual, rest = self._step(hidden, residual, branch_norm, args, kwargs)
        return (hidden, residual, *rest)

    def _step(self, hidden, residual, branch_norm, args, kwargs) -> tuple:
        """(hidden', residual', rest): the fused step."""
        if self.post_norm:
            if residual is not None or branch_norm is not None or isinstance(hidden, tuple):
                raise ValueError("a post_norm block takes the whole stream as hidden: residual and branch_norm "
                                 "must be None")
            out, rest = split_output(self.mixer(hidden, *args, **kwargs))
            # checked here, before norm_add would refuse it as its x
            if isinstance(out, Tensor) and out.shape != hidden.shape:
                raise ValueError(f"mixer ({type(self.mixer).__name__}) maps shape {tuple(hidden.shape)} to "
                                 f"{tuple(out.shape)}: a mixer must keep its input's shape")
            return self.branch_norm.norm_add(out, hidden, alpha=self.alpha, **self._scales()), None, rest
        normed, residual = self._enter(hidden, residual, branch_norm)
        out, rest = split_output(self.mixer(normed, *args, **self._kwargs_for(0, kwargs)))
        if self.parallel is None:
            return out, residual, rest
        if self.parallel_norm is not None:  # the second norm of the same sum: one more launch
            normed = self.parallel_norm(residual).to(normed.dtype)
        out1, rest1 = split_output(self.parallel(normed, *self._args_for(args), **self._kwargs_for(1, kwargs)))
        return (out, out1), residual, rest + rest1

    def _enter(self, hidden, residual, branch_norm):
        """(N(r'), r'): r' = hidden with no residual (the stream's input), else residual plus
        the branch `hidden` (a pair after a parallel block; normed by branch_norm after a
        sandwich block), in one launch."""
        pair = isinstance(hidden, tuple)
        if residual is None:
            if pair or branch_norm is not None:
                raise ValueError("a branch (a pair of outputs, or one for branch_norm) needs the residual it adds to")
            return self.norm.add(hidden, None)
        if branch_norm is not None:
            if pair:
                raise ValueError("branch_norm takes one branch, got a pair (a parallel block's outputs)")
            return branch_norm.norm_add_norm(hidden, residual, self.norm, alpha=self.alpha, **self._scales())
        if self.sandwich:
            raise ValueError("a sandwich block's hidden is the previous block's output before its branch norm: "
                             "pass branch_norm=previous_block.branch_norm")
        h, h1 = hidden if pair else (hidden, None)
        p = self.dropout if self.training else 0.0
        scales = self._scales()
        if h1 is None and self.alpha == 1.0 and p == 0.0 and not scales:  # add_norm's plain lane, keywords left out
            return self.norm.add(h, residual)
        return self.norm.add(h, residual, alpha=self.alpha, x1=h1, dropout_p=p, **scales)

    def naive(self, x: Tensor, *args, **kwargs):
        """The unfused step (x + alpha * drop(mixer(norm(x), *args, **kwargs)), or the form
        its options give) with the same parameters: x's new value, or `(new x, *rest)` for a
        mixer that returns `(out, *rest)`."""
        new, rest = self._naive_step(x, x.dtype, args, kwargs)
        return (new, *rest) if rest else new

    def _naive_step(self, h: Tensor, dtype: torch.dtype, args, kwargs, check=None) -> tuple[Tensor, tuple]:
        """(h + alpha * branch, rest) in plain torch ops; the mixers see `dtype`. check(out,
        what) sees each mixer's output first (the stack's error names its index)."""
        p = self.dropout if self.training else 0.0
        normed = (h if self.post_norm else self.norm.naive(h)).to(dtype)
        out, rest = split_output(self.mixer(normed, *args, **self._kwargs_for(0, kwargs)))
        if check is not None:
            check(out, "mixers")
        if self.branch_norm is not None:
            branch = self.branch_norm.naive(out)
        elif self.parallel is not None:
            if self.parallel_norm is not None:
                normed = self.parallel_norm.naive(h).to(dtype)
            out1, rest1 = split_output(self.parallel(normed, *self._args_for(args), **self._kwargs_for(1, kwargs)))
            if check is not None:
                check(out1, "parallel")
            branch, rest = _dropped(out, p) + _dropped(out1, p), rest + rest1
        else:
            branch = _dropped(out, p)
        return (_scaled(self.residual_scale, h)
                + _scaled(self.alpha if self.branch_scale is None else self.branch_scale, branch)), rest

    def extra_repr(self) -> str:
        """The shape's settings that differ from the default (the modules show their own)."""
        parts = [f"alpha={self.alpha}"] if self.alpha != 1.0 else []
        parts += [f"{k}=tensor of {v.shape[0]}" if isinstance(v, Tensor) else f"{k}={v}"
                  for k, v in self._scales().items() if v is not None and (isinstance(v, Tensor) or v != 1.0)]
        parts += [f"dropout={self.dropout}"] if self.dropout > 0.0 else []
        parts += [f"{name}=True" for name in ("sandwich", "post_norm") if getattr(self, name)]
        return ", ".join(parts)

    def room(self, which: int = 0) -> float:
        """How many positional side inputs the mixer (which=0) or the parallel module (1)
        takes after its input, read from its forward's signature once per module."""
        module = self.mixer if which == 0 else self.parallel
        cached, room = self._room_cache[which]
        if cached is not module:
            room = _positional_room(module)
            self._room_cache[which] = (module, room)
        return room

    def _args_for(self, args: tuple) -> tuple:
        """The parallel module's positional side inputs: the block's, where its forward takes
        them (an MLP's forward(x) beside an attention given cos, sin takes none)."""
        return args if not args or self.room(1) >= len(args) else ()

    def _kwargs_for(self, which: int, kwargs: dict) -> dict:
        """A parallel block's two modules each get the keywords their forward accepts; a
        single mixer gets what the block was given."""
        if self.parallel is None or not kwargs:
            return kwargs
        accepted = self._keywords(which)
        return kwargs if accepted is None else {k: v for k, v in kwargs.items() if k in accepted}

    @staticmethod
    def _read_keywords(mixer: nn.Module) -> frozenset[str] | None:
        # The block binds the first argument (the normed input), or for a fuses_prenorm
        # mixer the first two and prenorm=; a stack's keywords never stand in for those.
        if getattr(mixer, "fuses_prenorm", False):
            return keywords_accepted(mixer, 2, ("prenorm",))
        return keywords_accepted(mixer, 1)

    def _keywords(self, which: int | None = None) -> frozenset[str] | None:
        """The keywords a ResidualStack may pass this block's mixer (which=0), its parallel
        module (1), or either (None: the union); None for all of them. Read from each
        forward's signature once per module: again only after `.mixer` or `.parallel` is
        replaced."""
        if which is None:
            if self.parallel is None:
                return self._keywords(0)
            first, second = self._keywords(0), self._keywords(1)
            return None if first is None or second is None else first | second
        module = self.mixer if which == 0 else self.parallel
        cached, accepted = self._keywords_cache[which]
        if cached is not module:
            accepted = self._read_keywords(module)
            self._keywords_cache[which] = (module, accepted)
        return accepted


class ResidualStack(nn.Module):
    """Pre-norm sublayers over one residual stream, then an optional final norm.

    `forward(x, **kwargs) -> Tensor` with x's dtype, or with `return_extras=True`
    `(Tensor, extras)`: extras[k] is the tuple of what mixers[k] returned after its first
    element (attention weights, a new key/value cache), () for a mixer that returns a
    tensor (then what parallel[k] returned after its first). Each mixer gets the keyword
    arguments (masks, rotary embeddings, position ids) its forward accepts, all of them if
    it takes **kwargs; a keyword no mixer accepts is a TypeError. `fused=False` runs the
    naive form with the same parameters and state_dict keys, so one checkpoint serves both;
    `fused` and `return_extras` may be flipped on a built stack, and `alpha` and `dropout`
    set on it reach every block. kind, eps, bias,
    weight_offset and residual_dtype go to every norm (see PreNormBlock), and so do the
    shapes: `alpha`, `dropout`, `sandwich`, `post_norm` to every block, `parallel` an
    iterable of modules, parallel[k] the second mixer of block k. `stack_to_layers` /
    `layers_to_stack` map its state_dict keys to and from the
    `layers.{i}.{attn,mlp,input_norm,post_norm}` layout (the plain shape's keys only).
    """

    def __init__(
        self,
        mixers: Iterable[nn.Module],
        dim: int,
        *,
        kind: str = "rms",
        eps: float | None = None,
        final_norm: bool = True,
        fused: bool = True,
        residual_dtype: torch.dtype | None = None,
        bias: bool | None = None,
        weight_offset: float = 0.0,
        return_extras: bool = False,
        alpha: float = 1.0,
        dropout: float = 0.0,
        parallel: Iterable[nn.Module] | None = None,
        parallel_norm: bool = False,
        sandwich: bool = False,
        post_norm: bool = False,
        checkpoint: bool = False,
        residual_scale: float | Tensor = 1.0,
        branch_scale: float | Tensor | None = None,
    ):
        super().__init__()
        mixers = self.modules_of("mixers", mixers)
        if not mixers:
            raise ValueError("mixers must hold at least one nn.Module (one per sublayer), got none")
        seconds = [None] * len(mixers)
        if parallel is not None:
            seconds = self.modules_of("parallel", parallel)
            if len(seconds) != len(mixers):
                raise ValueError(f"parallel must hold one nn.Module per mixer ({len(mixers)}), got {len(seconds)}")
        for name, flag in (("final_norm", final_norm), ("fused", fused), ("return_extras", return_extras),
                           ("checkpoint", checkpoint)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        check_int("dim", dim)
        check_float_dtype("residual_dtype", residual_dtype)
        norm_kw = dict(kind=kind, eps=eps, bias=bias, residual_dtype=residual_dtype, weight_offset=weight_offset)
        self.blocks = nn.ModuleList(
            PreNormBlock(m, dim, alpha=alpha, dropout=dropout, parallel=m1, parallel_norm=parallel_norm,
                         sandwich=sandwich, post_norm=post_norm, residual_scale=residual_scale,
                         branch_scale=branch_scale, **norm_kw)
            for m, m1 in zip(mixers, seconds, strict=True))
        self.norm_f = AddNorm(dim, **norm_kw) if final_norm else None
        self.fused, self.return_extras, self.checkpoint = fused, return_extras, checkpoint
        self.residual_dtype = residual_dtype
        self.sandwich, self.post_norm = sandwich, post_norm
        self.alpha, self.dropout = self.blocks[0].alpha, dropout  # (a float branch_scale is alpha)

    # The stack's alpha and dropout are every block's: the fused form applies a block's at
    # the next block's entry and the stack's at its end, the naive form each block's to
    # its own branch, so set on a built stack they reach every block, or both forms would
    # differ. Each block checks the value as the constructor does.
    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        for block in self.blocks:
            block.alpha = value
        self._alpha = float(value)

    @property
    def dropout(self) -> float:
        return self._dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        for block in self.blocks:
            block.dropout = value
        self._dropout = float(value)

    @staticmethod
    def modules_of(name: str, modules) -> list[nn.Module]:
        # nn.ModuleList and nn.Sequential iterate over their sublayers; any other single
        # module is a mistake (it would silently become a stack of its children).
        if isinstance(modules, nn.Module) and not isinstance(modules, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"{name} must be an iterable of nn.Module (one per sublayer), got "
                            f"{type(modules).__name__}")
        try:
            modules = list(modules)
        except TypeError:
            raise TypeError(f"{name} must be an iterable of nn.Module, got {type(modules).__name__}") from None
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(f"{name}[{i}] must be an nn.Module, got {type(m).__name__}")
        return modules

    # The stack is the container of its blocks, as the nn.ModuleList it replaces
    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index):
        return self.blocks[index]

    def forward(self, x: Tensor, *args, **kwargs):
        routed = self._route(kwargs)
        positional = self._route_positional(args)
        out, extras = self._fused(x, routed, positional) if self.fused else self._naive(x, routed, positional)
        return (out, extras) if self.return_extras else out

    def _route(self, kwargs: dict) -> list[dict]:
        return route_keywords(kwargs, self.blocks, lambda block: block._keywords(), "ResidualStack")

    def _route_positional(self, args: tuple) -> list[tuple]:
        """Each block's positional side inputs: all of args for a mixer whose forward takes
        that many after its input, none for the others (an MLP's forward(x)); a parallel
        module the same within its block. Side inputs no mixer takes are a TypeError."""
        if not args:
            return [args] * len(self.blocks)
        routed = [args if b.room(0) >= len(args) else () for b in self.blocks]
        if not any(routed):
            raise TypeError(f"ResidualStack.forward got {len(args)} positional side input(s) that no mixer's forward "
                            f"takes")
        return routed

    def _call(self, fn, *args, **kwargs):
        # checkpoint=True: each block recomputed in backward (non-reentrant: what the block
        # returns may hold tensors in tuples, and keyword inputs pass as they are)
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)

    def _fused(self, x: Tensor, routed: list[dict], positional: list[tuple]) -> tuple[Tensor, tuple]:
        hidden, residual, branch_norm, extras = x, None, None, []
        for i, (block, kwargs, args) in enumerate(zip(self.blocks, routed, positional, strict=True)):
            # through the block's __call__, so its hooks run (FSDP2's gathering among them);
            # after a sandwich block the next one takes its branch norm into its launch
            out = (self._call(block, hidden, residual, *args, **kwargs) if branch_norm is None
                   else self._call(block, hidden, residual, *args, branch_norm=branch_norm,
                                   **kwargs))  # (hidden, residual, *rest)
            hidden, residual = out[0], out[1]
            parts = hidden if isinstance(hidden, tuple) else (hidden,)  # a parallel block's pair
            modules = (("mixers", block.mixer), ("parallel", block.parallel))[:len(parts)]
            for part, (what, module) in zip(parts, modules, strict=True):
                check_mixer_output(i, module, part, x, what)
            branch_norm = block.branch_norm if self.sandwich else None
            extras.append(tuple(out[2:]))
        # the per-channel scales, every block's (as alpha): the last block's output takes them here
        scales = self.blocks[-1]._scales()
        if self.post_norm:  # the whole stream is `hidden`
            out = hidden if self.norm_f is None else self.norm_f.add(hidden)[0]
        elif self.sandwich:  # o = N_f(r + alpha * N_b(p)), one norm_add_norm (or norm_add)
            out = (branch_norm.norm_add(hidden, residual, alpha=self.alpha, **scales) if self.norm_f is None
                   else branch_norm.norm_add_norm(hidden, residual, self.norm_f, alpha=self.alpha, **scales)[0])
        else:  # o = norm_f(r + alpha * (drop(p) + drop(p1))), one more launch
            h, h1 = hidden if isinstance(hidden, tuple) else (hidden, None)
            p = self.dropout if self.training else 0.0
            if self.norm_f is None:
                branch = _dropped(h, p) if h1 is None else _dropped(h, p) + _dropped(h1, p)
                last = self.blocks[-1]
                out = (_scaled(last.residual_scale, residual)
                       + _scaled(self.alpha if last.branch_scale is None else last.branch_scale, branch))
            elif h1 is None and self.alpha == 1.0 and p == 0.0 and not scales:  # add_norm's plain lane
                out = self.norm_f.add(h, residual)[0]
            else:
                out = self.norm_f.add(h, residual, alpha=self.alpha, x1=h1, dropout_p=p, **scales)[0]
        return out.to(x.dtype), tuple(extras)

    def _naive(self, x: Tensor, routed: list[dict], positional: list[tuple]) -> tuple[Tensor, tuple]:
        # The stream may be wider than the activations (residual_dtype): each mixer sees
        # x's dtype, as it does in the fused form.
        h, extras = (x if self.residual_dtype is None else x.to(self.residual_dtype)), []
        for i, (block, kwargs, args) in enumerate(zip(self.blocks, routed, positional, strict=True)):
            def check(out, what, i=i, block=block):
                check_mixer_output(i, block.parallel if what == "parallel" else block.mixer, out, x, what)
            h, rest = self._call(block._naive_step, h, x.dtype, args, kwargs, check)
            extras.append(rest)
        if self.norm_f is not None:
            h = self.norm_f.naive(h)
        return h.to(x.dtype), tuple(extras)

    def extra_repr(self) -> str:
        extra = "" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}"
        return (f"fused={self.fused}" + extra + (", return_extras=True" if self.return_extras else "")
                + (", checkpoint=True" if self.checkpoint else ""))


# ----------------------------------------------------------------- state_dict key maps
# A stack of attention and MLP sublayers in turn holds layer i as blocks 2i (its input
# norm and attention) and 2i + 1 (its post-attention norm and MLP). The common layout
# (Llama's, GPT-NeoX's, most ports') nests them as layers.{i}.{attn, mlp, input_norm,
# post_norm} and names the final norm `norm`; each name may be overridden, e.g.
# attn="self_attn", input_norm="input_layernorm", post_norm="post_attention_layernorm"
# for Hugging Face's Llama names.
_STACK_KEY = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(norm|mixer)\.(.+)")


def _layer_names(attn: str, mlp: str, input_norm: str, post_norm: str, final_norm: str,
                 layers: str = "layers") -> dict[str, str]:
    names = dict(attn=attn, mlp=mlp, input_norm=input_norm, post_norm=post_norm, final_norm=final_norm)
    for arg, name in names.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{arg} must be a module name (letters, digits, _; no dot), got {name!r}")
    if not isinstance(layers, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", layers):
        raise ValueError(f"layers must be a module path (names joined by dots, e.g. 'transformer.h'), got {layers!r}")
    if len(set(names.values())) != len(names) or final_norm == layers.split(".")[0]:
        raise ValueError(f"the names must differ from one another and final_norm from {layers!r}, got {names}")
    return names


def stack_to_layers(state_dict: Mapping[str, Tensor], *, attn: str = "attn", mlp: str = "mlp",
                    input_norm: str = "input_norm", post_norm: str = "post_norm",
                    final_norm: str = "norm", layers: str = "layers") -> dict[str, Tensor]:
    """A ResidualStack's state_dict (attention at even blocks, MLPs at odd ones) with the keys
    of the common layout: blocks.{2i}.norm.* -> layers.{i}.input_norm.*, blocks.{2i}.mixer.* ->
    layers.{i}.attn.*, blocks.{2i+1}.norm.* -> layers.{i}.post_norm.*, blocks.{2i+1}.mixer.* ->
    layers.{i}.mlp.*, norm_f.* -> norm.*. The same tensors, in the same order; a key of neither
    form is a ValueError. The inverse is `layers_to_stack`. `layers` is the blocks' path in
    place of `layers` (any `prefix.{i}.` layout: "transformer.h", "model.layers")."""
    names = _layer_names(attn, mlp, input_norm, post_norm, final_norm, layers)
    out = {}
    for key, value in state_dict.items():
        m = _STACK_KEY.fullmatch(key)
        if m:
            k, part, rest = int(m.group(1)), m.group(2), m.group(3)
            role = ("input_norm", "attn")[part == "mixer"] if k % 2 == 0 else ("post_norm", "mlp")[part == "mixer"]
            out[f"{layers}.{k // 2}.{names[role]}.{rest}"] = value
        elif key.startswith("norm_f."):
            out[f"{final_norm}.{key[len('norm_f.'):]}"] = value
        else:
            raise ValueError(f"state_dict key {key!r} is not a ResidualStack's (blocks.{{k}}.norm.*, "
                             f"blocks.{{k}}.mixer.*, norm_f.*): pass the stack's own state_dict")
    return out


def layers_to_stack(state_dict: Mapping[str, Tensor], *, attn: str = "attn", mlp: str = "mlp",
                    input_norm: str = "input_norm", post_norm: str = "post_norm",
                    final_norm: str = "norm", layers: str = "layers") -> dict[str, Tensor]:
    """The inverse of `stack_to_layers`: a state_dict in the layers.{i}.{attn,mlp,input_norm,
    post_norm}.* and norm.* layout with a ResidualStack's keys, for `stack.load_state_dict`.
    The same tensors, in the same order; any other key is a ValueError. `layers` as in
    `stack_to_layers`."""
    names = _layer_names(attn, mlp, input_norm, post_norm, final_norm, layers)
    where = {names["input_norm"]: (0, "norm"), names["attn"]: (0, "mixer"),
             names["post_norm"]: (1, "norm"), names["mlp"]: (1, "mixer")}
    layer_key = re.compile(rf"{re.escape(layers)}\.(0|[1-9][0-9]*)\.({'|'.join(map(re.escape, where))})\.(.+)")
    out = {}
    for key, value in state_dict.items():
        m = layer_key.fullmatch(key)
        if m:
            second, part = where[m.group(2)]
            out[f"blocks.{2 * int(m.group(1)) + second}.{part}.{m.group(3)}"] = value
        elif key.startswith(final_norm + "."):
            out[f"norm_f.{key[len(final_norm) + 1:]}"] = value
        else:
            raise ValueError(f"state_dict key {key!r} is not in the layers layout ({layers}.{{i}}.{{"
                             f"{','.join(where)}}}.*, {final_norm}.*)")
    return out
