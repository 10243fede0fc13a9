"""A small Llama-style decoder for tests, parity checks and the demo.

RMSNorm, rotary position embeddings computed from ``position_ids`` (``[B, S]``, ``[1, S]`` or a
flat ``[T]`` stream for THD batches), grouped-query attention through
``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` (so the CP transport
can serve it unmodified), a SwiGLU MLP and a tied or untied LM head. Parameter names follow
Hugging Face's ``LlamaForCausalLM`` so a state dict loads into either model, which is how the
tests check this decoder against an independent implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from cp_core.errors import CPBatchError, CPConfigError


@dataclass(frozen=True, kw_only=True)
class ReferenceModelConfig:
    """Shape and initialisation of :class:`ReferenceDecoder`."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise CPConfigError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CPConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise CPConfigError("the head size must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 like Llama's."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim and scale."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[B, S, head_dim]`` for ``[B, S]`` positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=position_ids.device) / head_dim))
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, D]`` by the angles of ``cos/sin [B, S, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention through SDPA."""

    def __init__(self, cfg: ReferenceModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, S, D]`` -> ``[B, S, D]``."""
        bsz, seq, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(bsz, seq, self.cfg.num_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.cfg.num_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.cfg.num_kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Fewer K/V heads go to SDPA as they are (enable_gqa), so the CP transport sees GQA.
        gqa = self.cfg.num_kv_heads != self.cfg.num_heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ReferenceModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention block and MLP block with residuals."""

    def __init__(self, cfg: ReferenceModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One decoder layer."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Embedding, layers and final norm (``model.*`` in Hugging Face naming)."""

    def __init__(self, cfg: ReferenceModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class ReferenceDecoder(nn.Module):
    """Llama-style causal LM; ``forward`` returns logits.

    Batches may be ``[B, S]`` rows or one flat ``[T]`` token stream (THD layouts); the logits
    have the same leading shape (``[B, S, V]`` or ``[T, V]``).
    """

    def __init__(self, cfg: ReferenceModelConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        if cfg is None:
            cfg = ReferenceModelConfig(**overrides)
        elif overrides:
            raise CPConfigError("pass either a ReferenceModelConfig or keyword overrides")
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters(cfg.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed``: normal(0, init_std) weights, unit norms.

        Parameters are drawn in ``named_parameters`` order from one CPU generator, so the same
        seed gives bit-identical weights in every process.
        """
        gen = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * self.cfg.init_std)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cp_slice_mesh: Any = None,
        cp_pad_multiple: int = 1,
        cp_slice_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits of the tokens.

        Args:
            input_ids: ``[B, S]`` or flat ``[T]`` tokens (exactly one of the two inputs).
            inputs_embeds: ``[B, S, D]`` or ``[T, D]`` embeddings.
            position_ids: positions for RoPE, ``[B, S]``, ``[1, S]`` or ``[S]`` / ``[T]``;
                ``arange`` when absent. Packed batches pass positions that restart per document.
            cp_slice_mesh: in-forward slicing (the aux-only layout): the inputs are the full
                sequence; after embedding, this rank keeps its head-tail chunks with
                :func:`cp_core.shard_sequence_for_cp_round_robin`. ``position_ids`` must then
                be the already sharded ones from the batch.
            cp_pad_multiple: the per-chunk pad multiple the aux-only sharder was built with.
            cp_slice_fn: in-forward slicing with any layout: called on the full ``[B, S, D]``
                embeddings, returns this rank's tokens (e.g.
                ``lambda h: sharder.shard_token_tensor(h, seq_dim=1, fill=0.0)``).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise CPBatchError("pass exactly one of input_ids and inputs_embeds")
        flat = (input_ids.dim() == 1) if input_ids is not None else inputs_embeds.dim() == 2
        h = self.model.embed_tokens(input_ids) if input_ids is not None else inputs_embeds
        if flat:
            h = h.unsqueeze(0)
        if cp_slice_mesh is not None:
            from cp_core.builtin import shard_sequence_for_cp_round_robin

            h, local_idx, _ = shard_sequence_for_cp_round_robin(
                cp_slice_mesh, h, seq_dim=1, pad_value=0, pad_multiple=cp_pad_multiple)
            if position_ids is None:
                position_ids = local_idx.unsqueeze(0)
        elif cp_slice_fn is not None:
            h = cp_slice_fn(h)
        bsz, seq = h.shape[0], h.shape[1]
        pos = self._positions(position_ids, bsz, seq, h.device)
        cos, sin = rotary_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        logits = self.lm_head(self.model.norm(h))
        return logits.squeeze(0) if flat else logits

    @staticmethod
    def _positions(position_ids: torch.Tensor | None, bsz: int, seq: int,
                   device: torch.device) -> torch.Tensor:
        if position_ids is None:
            return torch.arange(seq, device=device).unsqueeze(0).expand(bsz, seq)
        pos = position_ids.to(device)
        if pos.dim() == 1 and pos.shape[0] == seq:
            pos = pos.unsqueeze(0)
        if pos.dim() != 2 or pos.shape[1] != seq or pos.shape[0] not in (1, bsz):
            raise CPBatchError(
                f"position_ids has shape {tuple(position_ids.shape)}, expected [B, S] = "
                f"[{bsz}, {seq}], [1, S] or a flat [T] matching the tokens"
            )
        return pos.expand(bsz, seq)


__all__ = ["ReferenceModelConfig", "ReferenceDecoder", "RMSNorm", "rotary_cos_sin",
           "apply_rotary"]
