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
import re
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from .modules import AddNorm
from .ops.checks import check_float_dtype, check_int


def _split(out) -> tuple:
    """(new hidden state, extras) of a mixer's output: a tuple `(out, *rest)` (Hugging Face
    attention returns (out, weights)) gives (out, rest), a tensor gives (out, ())."""
    return (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())


def _keywords_accepted(mixer: nn.Module, bound: int, reserved: tuple[str, ...] = ()) -> frozenset[str] | None:
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


class PreNormBlock(nn.Module):
    """One pre-norm sublayer: `forward(hidden, residual=None, *args, **kwargs) -> (hidden, residual)`.

    residual' = hidden + residual, hidden' = mixer(norm(residual'), *args, **kwargs), the
    add and the norm in one launch. `mixer` is any module mapping (..., dim) to (..., dim);
    the extra arguments (rotary embeddings, masks, caches, position ids) go to it
    unchanged. A mixer that returns a tuple `(out, *rest)` (Hugging Face attention returns
    (out, weights)) makes the block return `(out, residual, *rest)`: the first element is
    the new hidden state, the rest follow the residual untouched.

    `norm` is an AddNorm (a Norm): the residual is kept in residual_dtype, by default the
    dtype of torch's `hidden + residual`. kind, eps, bias and weight_offset are Norm's
    (bias=None: a bias for kind="layer" only; eps=None: torch's default for the kind and the residual's dtype).

    A mixer with `fuses_prenorm = True` is called as `mixer(hidden, residual, *args,
    prenorm=norm, **kwargs) -> (hidden', residual')` instead: it applies `norm` itself,
    fused into its first Linear (fuseblock.norm_linear), so the normed activations are not
    kept for backward. The call goes through the mixer's __call__, so its hooks (FSDP2's
    gathering of its parameters among them) run as for any call. The naive form still
    calls `mixer(norm(x))`.
    """

    def __init__(
        self,
        mixer: nn.Module,
        dim: int,
        *,
        kind: str = "rms",
        eps: float | None = None,
        residual_dtype: torch.dtype | None = None,
        bias: bool | None = None,
        weight_offset: float = 0.0,
    ):
        super().__init__()
        if not isinstance(mixer, nn.Module):
            raise TypeError(f"mixer must be an nn.Module, got {type(mixer).__name__}")
        check_int("dim", dim)
        self.mixer = mixer
        self.norm = AddNorm(dim, kind=kind, eps=eps, bias=bias, residual_dtype=residual_dtype,
                            weight_offset=weight_offset)
        self._keywords_cache = (mixer, self._read_keywords(mixer))

    @property
    def residual_dtype(self) -> torch.dtype | None:
        return self.norm.residual_dtype

    def forward(self, hidden: Tensor, residual: Tensor | None = None, *args, **kwargs) -> tuple:
        # A mixer whose first op is a Linear on the normed input may take the norm in
        # with it (fuseblock.norm_linear, docs/stream.md): it is handed the un-normed sum.
        if getattr(self.mixer, "fuses_prenorm", False):
            return self.mixer(hidden, residual, *args, prenorm=self.norm, **kwargs)
        # residual by keyword: a parallel style's input hook (torch's SequenceParallel keeps only
        # the first positional input) can then not drop it (docs/parallel.md)
        normed, residual = self.norm(hidden, residual=residual)
        out = self.mixer(normed, *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0], residual, *out[1:])
        return out, residual

    def naive(self, x: Tensor, *args, **kwargs):
        """The unfused step x + mixer(norm(x), *args, **kwargs) with the same parameters:
        x's new value, or `(new x, *rest)` for a mixer that returns `(out, *rest)`."""
        out = self.mixer(self.norm.naive(x), *args, **kwargs)
        if isinstance(out, tuple):
            return (x + out[0], *out[1:])
        return x + out

    @staticmethod
    def _read_keywords(mixer: nn.Module) -> frozenset[str] | None:
        # The block binds the first argument (the normed input), or for a fuses_prenorm
        # mixer the first two and prenorm=; a stack's keywords never stand in for those.
        if getattr(mixer, "fuses_prenorm", False):
            return _keywords_accepted(mixer, 2, ("prenorm",))
        return _keywords_accepted(mixer, 1)

    def _keywords(self) -> frozenset[str] | None:
        """The keywords a ResidualStack may pass this block's mixer (None: all of them), read
        from its forward's signature once per mixer: again only after `.mixer` is replaced."""
        mixer, accepted = self._keywords_cache
        if mixer is not self.mixer:
            self._keywords_cache = (self.mixer, self._read_keywords(self.mixer))
            accepted = self._keywords_cache[1]
        return accepted


class ResidualStack(nn.Module):
    """Pre-norm sublayers over one residual stream, then an optional final norm.

    `forward(x, **kwargs) -> Tensor` with x's dtype, or with `return_extras=True`
    `(Tensor, extras)`: extras[k] is the tuple of what mixers[k] returned after its first
    element (attention weights, a new key/value cache), () for a mixer that returns a
    tensor. Each mixer gets the keyword arguments (masks, rotary embeddings, position ids)
    its forward accepts, all of them if it takes **kwargs; a keyword no mixer accepts is a
    TypeError. `fused=False` runs the naive form with the same parameters and state_dict
    keys, so one checkpoint serves both; `fused` and `return_extras` may be flipped on a
    built stack. kind, eps, bias, weight_offset and residual_dtype go to every norm (see
    PreNormBlock). `stack_to_layers` / `layers_to_stack` map its state_dict keys to and
    from the `layers.{i}.{attn,mlp,input_norm,post_norm}` layout.
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
    ):
        super().__init__()
        # nn.ModuleList and nn.Sequential iterate over their sublayers; any other single
        # module is a mistake (it would silently become a stack of its children).
        if isinstance(mixers, nn.Module) and not isinstance(mixers, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"mixers must be an iterable of nn.Module (one per sublayer), got {type(mixers).__name__}")
        try:
            mixers = list(mixers)
        except TypeError:
            raise TypeError(f"mixers must be an iterable of nn.Module, got {type(mixers).__name__}") from None
        if not mixers:
            raise ValueError("mixers must hold at least one nn.Module (one per sublayer), got none")
        for i, m in enumerate(mixers):
            if not isinstance(m, nn.Module):
                raise TypeError(f"mixers[{i}] must be an nn.Module, got {type(m).__name__}")
        for name, flag in (("final_norm", final_norm), ("fused", fused), ("return_extras", return_extras)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        check_int("dim", dim)
        check_float_dtype("residual_dtype", residual_dtype)
        norm_kw = dict(kind=kind, eps=eps, bias=bias, residual_dtype=residual_dtype, weight_offset=weight_offset)
        self.blocks = nn.ModuleList(PreNormBlock(m, dim, **norm_kw) for m in mixers)
        self.norm_f = AddNorm(dim, **norm_kw) if final_norm else None
        self.fused, self.return_extras = fused, return_extras
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, **kwargs):
        routed = self._route(kwargs)
        out, extras = self._fused(x, routed) if self.fused else self._naive(x, routed)
        return (out, extras) if self.return_extras else out

    def _route(self, kwargs: dict) -> list[dict]:
        """Each block's keyword arguments: those its mixer's forward accepts."""
        if not kwargs:
            return [kwargs] * len(self.blocks)
        routed, used = [], set()
        for block in self.blocks:
            accepted = block._keywords()
            mine = kwargs if accepted is None else {k: v for k, v in kwargs.items() if k in accepted}
            used.update(mine)
            routed.append(mine)
        unused = [k for k in kwargs if k not in used]
        if unused:
            raise TypeError(f"ResidualStack.forward got keyword argument(s) {', '.join(map(repr, unused))} "
                            f"that no mixer's forward accepts")
        return routed

    def _fused(self, x: Tensor, routed: list[dict]) -> tuple[Tensor, tuple]:
        hidden, residual, extras = x, None, []
        for i, (block, kwargs) in enumerate(zip(self.blocks, routed, strict=True)):
            out = block(hidden, residual, **kwargs)  # (hidden, residual, *rest)
            hidden, residual = out[0], out[1]
            self._check_mixer_output(i, hidden, x)
            extras.append(tuple(out[2:]))
        if self.norm_f is not None:  # o = norm_f(p_n + r_n), one more launch
            out = self.norm_f(hidden, residual=residual)[0]
        else:
            out = hidden + residual
        return out.to(x.dtype), tuple(extras)

    def _naive(self, x: Tensor, routed: list[dict]) -> tuple[Tensor, tuple]:
        # The stream may be wider than the activations (residual_dtype): each mixer sees
        # x's dtype, as it does in the fused form.
        h, extras = (x if self.residual_dtype is None else x.to(self.residual_dtype)), []
        for i, (block, kwargs) in enumerate(zip(self.blocks, routed, strict=True)):
            out, rest = _split(block.mixer(block.norm.naive(h).to(x.dtype), **kwargs))
            self._check_mixer_output(i, out, x)
            h = h + out
            extras.append(rest)
        if self.norm_f is not None:
            h = self.norm_f.naive(h)
        return h.to(x.dtype), tuple(extras)

    def _check_mixer_output(self, i: int, out, x: Tensor) -> None:
        # Unchecked, a wrong width reaches the next norm, which refuses it as x's last dim.
        if not isinstance(out, Tensor):
            raise TypeError(f"mixers[{i}] ({type(self.blocks[i].mixer).__name__}) returned "
                            f"{type(out).__name__}, not a tensor (or a tuple whose first element is one)")
        if out.shape != x.shape:
            raise ValueError(f"mixers[{i}] ({type(self.blocks[i].mixer).__name__}) maps last dim {x.shape[-1]} "
                             f"to {out.shape[-1]} (shape {tuple(x.shape)} to {tuple(out.shape)}): every mixer "
                             f"must map (..., {x.shape[-1]}) to the same shape")

    def extra_repr(self) -> str:
        extra = "" if self.residual_dtype is None else f", residual_dtype={self.residual_dtype}"
        return f"fused={self.fused}" + extra + (", return_extras=True" if self.return_extras else "")


# ----------------------------------------------------------------- state_dict key maps
# A stack of attention and MLP sublayers in turn holds layer i as blocks 2i (its input
# norm and attention) and 2i + 1 (its post-attention norm and MLP). The common layout
# (Llama's, GPT-NeoX's, most ports') nests them as layers.{i}.{attn, mlp, input_norm,
# post_norm} and names the final norm `norm`; each name may be overridden, e.g.
# attn="self_attn", input_norm="input_layernorm", post_norm="post_attention_layernorm"
# for Hugging Face's Llama names.
_STACK_KEY = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(norm|mixer)\.(.+)")


def _layer_names(attn: str, mlp: str, input_norm: str, post_norm: str, final_norm: str) -> dict[str, str]:
    names = dict(attn=attn, mlp=mlp, input_norm=input_norm, post_norm=post_norm, final_norm=final_norm)
    for arg, name in names.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{arg} must be a module name (letters, digits, _; no dot), got {name!r}")
    if len(set(names.values())) != len(names) or final_norm == "layers":
        raise ValueError(f"the names must differ from one another and final_norm from 'layers', got {names}")
    return names


def stack_to_layers(state_dict: Mapping[str, Tensor], *, attn: str = "attn", mlp: str = "mlp",
                    input_norm: str = "input_norm", post_norm: str = "post_norm",
                    final_norm: str = "norm") -> dict[str, Tensor]:
    """A ResidualStack's state_dict (attention at even blocks, MLPs at odd ones) with the keys
    of the common layout: blocks.{2i}.norm.* -> layers.{i}.input_norm.*, blocks.{2i}.mixer.* ->
    layers.{i}.attn.*, blocks.{2i+1}.norm.* -> layers.{i}.post_norm.*, blocks.{2i+1}.mixer.* ->
    layers.{i}.mlp.*, norm_f.* -> norm.*. The same tensors, in the same order; a key of neither
    form is a ValueError. The inverse is `layers_to_stack`."""
    names = _layer_names(attn, mlp, input_norm, post_norm, final_norm)
    out = {}
    for key, value in state_dict.items():
        m = _STACK_KEY.fullmatch(key)
        if m:
            k, part, rest = int(m.group(1)), m.group(2), m.group(3)
            role = ("input_norm", "attn")[part == "mixer"] if k % 2 == 0 else ("post_norm", "mlp")[part == "mixer"]
            out[f"layers.{k // 2}.{names[role]}.{rest}"] = value
        elif key.startswith("norm_f."):
            out[f"{final_norm}.{key[len('norm_f.'):]}"] = value
        else:
            raise ValueError(f"state_dict key {key!r} is not a ResidualStack's (blocks.{{k}}.norm.*, "
                             f"blocks.{{k}}.mixer.*, norm_f.*): pass the stack's own state_dict")
    return out


def layers_to_stack(state_dict: Mapping[str, Tensor], *, attn: str = "attn", mlp: str = "mlp",
                    input_norm: str = "input_norm", post_norm: str = "post_norm",
                    final_norm: str = "norm") -> dict[str, Tensor]:
    """The inverse of `stack_to_layers`: a state_dict in the layers.{i}.{attn,mlp,input_norm,
    post_norm}.* and norm.* layout with a ResidualStack's keys, for `stack.load_state_dict`.
    The same tensors, in the same order; any other key is a ValueError."""
    names = _layer_names(attn, mlp, input_norm, post_norm, final_norm)
    where = {names["input_norm"]: (0, "norm"), names["attn"]: (0, "mixer"),
             names["post_norm"]: (1, "norm"), names["mlp"]: (1, "mixer")}
    layer_key = re.compile(rf"layers\.(0|[1-9][0-9]*)\.({'|'.join(map(re.escape, where))})\.(.+)")
    out = {}
    for key, value in state_dict.items():
        m = layer_key.fullmatch(key)
        if m:
            second, part = where[m.group(2)]
            out[f"blocks.{2 * int(m.group(1)) + second}.{part}.{m.group(3)}"] = value
        elif key.startswith(final_norm + "."):
            out[f"norm_f.{key[len(final_norm) + 1:]}"] = value
        else:
            raise ValueError(f"state_dict key {key!r} is not in the layers layout (layers.{{i}}.{{"
                             f"{','.join(where)}}}.*, {final_norm}.*)")
    return out
