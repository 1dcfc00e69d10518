"""DeepSeek-V3 model: MLA + (dense | DeepSeekMoE) decoder layers, shared embedding/head, MTP modules.

Module names follow the released checkpoint (minus the `model.` prefix), so the HF key map in
`checkpoint/hf.py` is a rename, not a reshuffle. Device-agnostic PyTorch: no framework imports here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.init import draw_base_seed, init_parameter_
from dsv3_plugin.model.mla import MLA
from dsv3_plugin.model.moe.layer import DeepSeekMoE, DenseMLP, GroupedExperts
from dsv3_plugin.model.mtp import MTPLayer, mtp_depth_loss
from dsv3_plugin.model.norm import RMSNorm
from dsv3_plugin.model.packing import IGNORE_INDEX, lm_mean, mtp_labels, mtp_rows, rope_tables
from dsv3_plugin.model.rope import RotaryEmbedding

__all__ = ["DecoderLayer", "DSv3Model", "DSv3Output"]


class DecoderLayer(nn.Module):
    """Pre-norm block: x + MLA(norm(x)), then x + FFN(norm(x)); FFN is dense for the first
    `first_k_dense_replace` layers and DeepSeekMoE after (the MTP blocks are MoE layers too)."""

    def __init__(self, cfg: DSv3Config, layer_idx: int):
        super().__init__()
        m = cfg.model
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.self_attn = MLA(m)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.mlp = (
            DeepSeekMoE(m.hidden_size, cfg.moe)
            if cfg.is_moe_layer(layer_idx)
            else DenseMLP(m.hidden_size, m.intermediate_size)
        )

    def forward(
        self,
        x_BTH: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. cos/sin: RoPE tables ([T, d_R/2] or per row [B, 1, T, d_R/2]); attn_mask
        [B, 1, T, T] bool: packed rows' document-causal mask (None: plain causal); token_mask [B, T] bool: False at
        padding, which the MoE layer leaves out of its expert loads (`model.packing`)."""
        x_BTH = x_BTH + self.self_attn(self.input_layernorm(x_BTH), cos, sin, attn_mask)
        return x_BTH + self.ffn(self.post_attention_layernorm(x_BTH), token_mask)

    def ffn(self, h_BTH: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN on the normalized input; the padding mask reaches a MoE layer only (a dense MLP has no loads)."""
        if token_mask is None or not isinstance(self.mlp, DeepSeekMoE):
            return self.mlp(h_BTH)
        return self.mlp(h_BTH, token_mask)


@dataclass
class DSv3Output:
    logits: torch.Tensor  # [B, T, V]
    mtp_logits: list[torch.Tensor] = field(default_factory=list)  # k-th: [B, T-k, V], row i -> token i+k+1
    hidden: torch.Tensor | None = None  # [B, T, H] after the final norm
    loss: torch.Tensor | None = None  # lm + λ·mtp + balance
    lm_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None  # (1/D) Σ_k L^k (unweighted by λ)
    balance_loss: torch.Tensor | None = None  # Σ over MoE layers of α·L_Bal


class DSv3Model(nn.Module):
    """The plain model (FP32/BF16 GEMMs, no recompute). `training.transforms.build_model(cfg)` is how the entry
    points build it: that applies the `fp8` and `memory.recompute` sections of `cfg`, which this class only
    stores."""

    def __init__(self, cfg: DSv3Config):
        """Build the embedding, the decoder layers (dense for the first `model.first_k_dense_replace`, DeepSeekMoE
        after), the final norm and output head (tied to the embedding when `model.tie_word_embeddings`), the
        `mtp.depth` MTP modules and the RoPE tables, and initialise the weights (`reset_parameters`).

        Args:
            cfg: the validated config (`DSv3Config.from_block`, `load_config`, `DSv3Config.from_hf`).

        Raises:
            TypeError: `cfg` is not a `DSv3Config`.
        """
        super().__init__()
        if not isinstance(cfg, DSv3Config):
            raise TypeError(f"DSv3Model: cfg must be a DSv3Config (got {type(cfg).__name__}; DSv3Config.from_block)")
        self.cfg = cfg
        m = cfg.model
        # The weights come from `init_seed` alone (one draw from the global generator); the submodules' own
        # initialisers run on a forked generator, so a build advances the global one by exactly that draw
        # whether it allocates everything or builds on the meta device (`training.rank_local`).
        self.init_seed = draw_base_seed()
        with torch.random.fork_rng(devices=[]):
            self.embed_tokens = nn.Embedding(m.vocab_size, m.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(m.num_hidden_layers))
            self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
            self.lm_head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
            if m.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
            self.mtp = nn.ModuleList(
                MTPLayer(m.hidden_size, m.rms_norm_eps, DecoderLayer(cfg, m.num_hidden_layers + k))
                for k in range(cfg.mtp.depth)
            )
        self.rotary = RotaryEmbedding(m)
        self.reset_parameters(self.init_seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """N(0, initializer_range) for every matrix (paper §4.2: std 0.006), ones for norms, zero router biases;
        each tensor keyed by (seed, its name, its global expert index) (`model.init`; seed None: a fresh draw
        from the global generator). Parameters on the meta device are skipped (a rank-local build fills the
        ones it owns with the same values)."""
        base = draw_base_seed() if seed is None else seed
        std = self.cfg.model.initializer_range
        seen: set[int] = set()  # a tied head is the embedding: initialised once, under the embedding's name
        for mod_name, mod in self.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if p.is_meta or id(p) in seen:
                    continue
                seen.add(id(p))
                name = f"{mod_name}.{pname}" if mod_name else pname
                offset = getattr(mod, "expert_range", range(0)).start if isinstance(mod, GroupedExperts) else None
                init_parameter_(p, name, std, base, offset)
        for mod in self.modules():
            if hasattr(mod, "e_score_correction_bias") and not mod.e_score_correction_bias.is_meta:
                mod.e_score_correction_bias.zero_()
                mod.tokens_per_expert.zero_()

    def moe_layers(self) -> list[DeepSeekMoE]:
        return [mod for mod in self.modules() if isinstance(mod, DeepSeekMoE)]

    def rope(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(torch.arange(T, device=device), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        tokens_seen: float = 0.0,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> DSv3Output:
        """Logits of the main model and of each MTP depth, and with `labels` the training loss.

        Args:
            input_ids: token ids, [B, T] (int64).
            labels: the target of each position, [B, T] (int64): `labels[:, t]` is the token after position t
                (the inputs shifted left by one); -100 is ignored. None: no losses.
            tokens_seen: training tokens so far, for the MTP loss weight's schedule (`mtp.lam`).
            position_ids: [B, T] int64, restarting at 0 at each document start (packed rows): RoPE at these
                positions, attention causal inside each document, MTP targets outside the position's document
                ignored (`model.packing`). None: positions 0..T-1, plain causal attention (one document per row).
            token_mask: [B, T] bool, False at padding: computed like every token but not counted in the experts'
                loads (the bias update's counts, MaxVio) nor in the balance loss's statistics. None: no padding.

        Returns:
            A `DSv3Output`: `logits` [B, T, V]; `mtp_logits[k-1]` [B, T-k, V] for depth k (row i predicts token
            i+k+1; depths with T-k <= 0 are skipped); `hidden` [B, T, H] after the final norm. With `labels`:
            `lm_loss` (mean token cross-entropy over the loss tokens; 0 without any), `mtp_loss` (the mean of L^k
            over the depths computed: paper eq. 25 without λ; L^k divided by the number of loss tokens, `model.mtp`
            NOTE), `balance_loss` (Σ over MoE layers of the sequence-wise α·L_Bal; in training mode with α > 0
            only) and `loss` = lm_loss + λ·mtp_loss + balance_loss.
        """
        B, T = input_ids.shape
        for moe in self.moe_layers():
            moe.aux_loss = None  # a depth skipped below (T too short) must not leave a stale loss
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            cos, sin = self.rope(T, x.device, x.dtype)
            attn_mask = None
        else:
            cos, sin, attn_mask = rope_tables(self.rotary, T, position_ids, x.device, x.dtype)
        for layer in self.layers:
            if attn_mask is None and token_mask is None:
                x = layer(x, cos, sin)
            else:
                x = layer(x, cos, sin, attn_mask, token_mask)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)

        mtp_logits, h_prev = [], hidden
        for k, mtp in enumerate(self.mtp, start=1):
            S = T - k
            if S <= 0:
                break
            emb = self.embed_tokens(input_ids[:, k:])  # Emb(t_{i+k}), [B, S, H]
            h_prev = mtp(h_prev[:, :S], emb, *mtp_rows(cos, sin, attn_mask, token_mask, k))  # h^k, [B, S, H]
            mtp_logits.append(self.lm_head(mtp.norm(h_prev)))  # [B, S, V]

        out = DSv3Output(logits=logits, mtp_logits=mtp_logits, hidden=hidden)
        if labels is not None:
            self._losses(out, labels, tokens_seen, position_ids)
        return out

    def _losses(
        self, out: DSv3Output, labels: torch.Tensor, tokens_seen: float, position_ids: torch.Tensor | None = None
    ) -> None:
        T = labels.shape[1]
        n_loss = (labels != IGNORE_INDEX).sum()  # B·T when nothing is masked: eq. 24 as written
        out.lm_loss = lm_mean(out.logits, labels, n_loss)
        out.loss = out.lm_loss
        if out.mtp_logits:
            depth_losses = [
                mtp_depth_loss(lg, mtp_labels(labels, k, position_ids), T, n_loss)
                for k, lg in enumerate(out.mtp_logits, 1)
            ]
            out.mtp_loss = torch.stack(depth_losses).mean()
            out.loss = out.loss + self.cfg.mtp.lam(tokens_seen) * out.mtp_loss
        aux = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        if aux:
            out.balance_loss = torch.stack(aux).sum()
            out.loss = out.loss + out.balance_loss
