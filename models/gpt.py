"""A small GPT whose residual stream is fuseblock's: every attention and MLP sublayer is a
`fuseblock.PreNormBlock`, all of them in one `fuseblock.ResidualStack` with a final norm.
Fused, each block's norm and the Linear that consumes it (c_attn, c_fc) run as one
`fuseblock.norm_linear` (the mixers' `prenorm=` call), which keeps no normed activations.

With norm="layer", bias=True and norm_eps=1e-5 it computes the same function as
nanoGPT's GPT for the same weights; fused=False runs the naive stack, same state_dict.
hc=n puts the sublayers on n residual streams instead (`fuseblock.HyperConnectionStack`,
mHC with Sinkhorn, docs/gpt.md): there the mixers get the collapsed, normed input.
attn_res=B makes each sublayer's input an attention residual over blocks of B sublayers
(`fuseblock.AttnResStack`, Kimi's Block AttnRes, docs/gpt.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import fuseblock
from fuseblock.attn_res_spec import MAX_SOURCES
from fuseblock.attn_res_stream import AttnResStack, head_states
from fuseblock.hyper_stream import HyperBlock, HyperConnectionStack, HyperHead
from fuseblock.ops.hyper import MAX_STREAMS

from .sharded import fill

# GPTConfig.fp8: the recipe each name stands for (norm_linear's quant), None for none
FP8_RECIPES = {None: None, "row": "fp8_row"}


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in Linear layers and norms, as GPT-2
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    fused: bool = True  # False: the naive pre-norm stack, same parameters
    residual_dtype: torch.dtype | None = None  # e.g. torch.float32 under bf16
    hc: int = 0  # residual streams: 0 the plain stack; n >= 1 hyper-connections (mHC, Sinkhorn) on n streams
    fp8: str | None = None  # "row": the Linear after each block norm in fp8, rowwise (norm_linear quant="fp8_row")
    attn_res: int = 0  # 0 the plain stack; B >= 1 attention residuals over blocks of B sublayers (AttnResStack)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        rd = self.residual_dtype
        if rd is not None and not (isinstance(rd, torch.dtype) and rd.is_floating_point):
            raise TypeError(f"residual_dtype must be a floating torch.dtype or None, got {rd!r}")
        if isinstance(self.hc, bool) or not isinstance(self.hc, int) or not 0 <= self.hc <= MAX_STREAMS:
            raise ValueError(f"hc must be an int in [0, {MAX_STREAMS}] (0: one plain stream), got {self.hc!r}")
        if self.hc and self.norm != "rms":
            raise ValueError(f"hc={self.hc} needs norm='rms' (hyper-connections normalize with RMS norms), "
                             f"got {self.norm!r}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {sorted(FP8_RECIPES, key=str)}, got {self.fp8!r}")
        if self.fp8 and (self.hc or self.attn_res or not self.fused):
            raise ValueError(f"fp8={self.fp8!r} runs through the fused norm + Linear of the plain stack: needs "
                             f"fused=True, hc=0 and attn_res=0, got fused={self.fused}, hc={self.hc}, "
                             f"attn_res={self.attn_res}")
        if self.hc and rd not in (None, torch.float32):
            raise ValueError(f"hc={self.hc} keeps the streams in the embeddings' dtype: residual_dtype must be None "
                             f"or torch.float32, got {rd}")

        if isinstance(self.attn_res, bool) or not isinstance(self.attn_res, int) or self.attn_res < 0:
            raise ValueError(f"attn_res must be an int >= 0 (0: the plain stack), got {self.attn_res!r}")
        if self.attn_res and (self.hc or self.norm != "rms" or rd not in (None, torch.float32)):
            raise ValueError(f"attn_res={self.attn_res} needs hc=0, norm='rms' and residual_dtype None or "
                             f"torch.float32 (the states stay in the embeddings' dtype), got hc={self.hc}, "
                             f"norm={self.norm!r}, residual_dtype={rd}")
        if self.attn_res and head_states(2 * self.n_layer, self.attn_res) > MAX_SOURCES:
            raise ValueError(f"attn_res={self.attn_res} with n_layer={self.n_layer} makes "
                             f"{head_states(2 * self.n_layer, self.attn_res)} block states for the head to mix, more "
                             f"than {MAX_SOURCES}: use attn_res >= {-(-2 * self.n_layer // (MAX_SOURCES - 1))}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["residual_dtype"] = None if self.residual_dtype is None else str(self.residual_dtype).removeprefix("torch.")
        return d

    @classmethod
    def from_json(cls, d: dict) -> GPTConfig:
        d = dict(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown config fields {sorted(unknown)}")
        rd = d.get("residual_dtype")
        if rd is not None:
            dtype = getattr(torch, str(rd), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"residual_dtype {rd!r} is not a torch dtype")
            d["residual_dtype"] = dtype
        return cls(**d)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_size, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    fuses_prenorm = True  # fuseblock.PreNormBlock passes the un-normed sum and its norm as prenorm=

    def forward(self, x, residual=None, prenorm=None):  # (B, T, C) -> (B, T, C)
        if prenorm is None:  # x is normed already (the naive stack)
            return self._attend(self.c_attn(x))
        # the fused stream: the block's norm and c_attn in one (fuseblock.norm_linear)
        qkv, residual = prenorm.add_linear(x, residual, self.c_attn)  # over both modules' own parameters
        return self._attend(qkv), residual

    def _attend(self, qkv):  # (B, T, 3C) -> (B, T, C)
        # C is n_embd, or under tensor parallelism (models/tensor_parallel.py) this rank's
        # share: the q, k and v columns of its heads, so the head count is read off C
        B, T, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(C, dim=2)
        hs = self.head_size
        q, k, v = (t.view(B, T, C // hs, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    fuses_prenorm = True  # as CausalSelfAttention's

    def forward(self, x, residual=None, prenorm=None):  # (B, T, C) -> (B, T, C)
        if prenorm is None:
            return self._out(self.c_fc(x))
        h, residual = prenorm.add_linear(x, residual, self.c_fc)  # the block's norm and c_fc in one
        return self._out(h), residual

    def _out(self, h):  # (B, T, 4C) -> (B, T, C)
        return self.dropout(self.c_proj(F.gelu(h)))  # exact GELU, as GPT-2


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.config = cfg
        rng = torch.get_rng_state()
        mixers = [m for _ in range(cfg.n_layer) for m in (CausalSelfAttention(cfg), MLP(cfg))]
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.hc:  # n streams: each block's boundary (and the head) one hc_add_norm (hc_head) launch
            self.stack = HyperConnectionStack(mixers, cfg.n_embd, streams=cfg.hc, eps=cfg.norm_eps, fused=cfg.fused)
        elif cfg.attn_res:  # each sublayer's add, mix and norm (and the head's) one attn_res_add_norm launch
            self.stack = AttnResStack(mixers, cfg.n_embd, block_size=cfg.attn_res, eps=cfg.norm_eps, fused=cfg.fused)
        else:
            self.stack = fuseblock.ResidualStack(
                mixers, cfg.n_embd, kind=cfg.norm, eps=cfg.norm_eps, final_norm=True, fused=cfg.fused,
                residual_dtype=cfg.residual_dtype, bias=cfg.bias,
            )
        if cfg.fp8:  # the block norms' fused Linears (norm_linear) in fp8
            for m in self.stack.modules():
                if isinstance(m, fuseblock.Norm):
                    m.linear_quant = FP8_RECIPES[cfg.fp8]
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # The weights are a function of the seed alone: the submodules' own default inits
        # above are overwritten, so init_weights draws from where construction began, as it
        # does after a meta-device build (whose inits draw nothing).
        torch.set_rng_state(rng)
        if not self.wte.weight.is_meta:  # a meta build waits for to_empty, then init_weights()
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every parameter as construction does, from torch's global RNG: Linear and
        Embedding weights N(0, 0.02), the residual projections (c_proj) N(0, 0.02 / sqrt(2
        n_layer)) as GPT-2, biases zeros, norms their reset_parameters(). After
        `torch.manual_seed(s)`, a model built on the meta device, moved with `to_empty` (and
        sharded with FSDP2's fully_shard, or not) and then given init_weights() holds what
        `torch.manual_seed(s); GPT(cfg)` holds, bit for bit. Weights are drawn whole on the CPU
        and copied in (a shard keeps its part), so one seed gives one model on any device and
        any number of ranks. Also re-ties the LM head to the token embedding (to_empty
        unties them)."""
        if self.lm_head.weight is not self.wte.weight:
            self.lm_head.weight = self.wte.weight
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            if m is self.lm_head:
                continue  # its weight is wte's
            if isinstance(m, (HyperBlock, HyperHead)):  # DeepSeek-V4's init, fn drawn whole as the weights
                fill(m.fn, torch.empty(m.fn.shape, dtype=m.fn.dtype, device="cpu").normal_(0.0, 0.02))
                for p, value in ((m.base, 0.0), (m.scale, 1.0), (m.weight, 1.0)):
                    nn.init.constant_(p, value)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                fill(m.weight, torch.empty(m.weight.shape, dtype=m.weight.dtype, device="cpu").normal_(
                    0.0, proj_std if name.endswith(".c_proj") else 0.02))
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def forward(self, idx, targets=None):  # idx (B, T) int64 -> logits (B, T, vocab), loss
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        logits = self.lm_head(self.stack(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, generator=None):
        """Append max_new_tokens sampled tokens to idx (B, T) -> (B, T + max_new_tokens).

        Each step sees the last block_size tokens; temperature 0 is greedy decoding and
        top_k keeps only the k likeliest tokens."""
        if idx.dim() != 2 or idx.shape[1] < 1 or idx.dtype != torch.long:
            raise ValueError(f"idx must be a (B, T) int64 tensor with T >= 1, got {tuple(idx.shape)} {idx.dtype}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not number or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float()  # (B, vocab)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx

    def optimizer_groups(self, weight_decay: float):
        """AdamW groups: decay matrices and embeddings, not biases and norm weights."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
