"""A small decoder-only transformer in plain PyTorch: token embedding, RMSNorm, rotary
positions from ``position_ids``, causal attention masked per document
(``zephon_state.block_causal_mask``), SwiGLU MLP, untied output head. No dropout, so no
randomness outside the initialisation (seeded by the run's seed alone)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zephon_state import block_causal_mask

from flextrain.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, position_ids: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate pairs of ``x`` ``[B, H, T, Dh]`` by angles of each token's position."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = position_ids[:, None, :, None].to(torch.float32) * inv  # [B, 1, T, half]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.attn_norm = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.gate = nn.Linear(d, cfg.d_ff, bias=False)
        self.up = nn.Linear(d, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, d, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.cfg.n_heads
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, position_ids, self.cfg.rope_base), rotary(k, position_ids, self.cfg.rope_base)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int) -> None:
        """Deterministic from ``seed`` alone (every rank builds the same model)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 2:
                    std = self.cfg.init_std / ((2 * self.cfg.n_layers) ** 0.5 if name.endswith(("proj.weight", "down.weight")) else 1)
                    p.normal_(0.0, std, generator=g)
                else:
                    p.fill_(1.0)

    def hidden_matrices(self) -> list[str]:
        """The 2-D weights inside the blocks: Muon's; embedding, head and norms go to AdamW."""
        return [n for n, p in self.named_parameters() if p.ndim == 2 and n.startswith("layers.")]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        mask = block_causal_mask(document_ids)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids, mask)
        return self.head(self.norm(x))


def token_loss_sum(model: Transformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Sum of token cross-entropies over non-ignored labels, and their count."""
    logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    labels = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())
