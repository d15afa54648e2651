"""The built-in target's shape and its MTP head, as trained: a transformers Qwen3.5 text model plus one MTP layer.

Owns: the target config (sizes, layer schedule, RoPE, special ids) and the training-side MTP module whose parameter
names are the checkpoint's `mtp.*` names. Does not own: the training loop (train_target.py), writing files
(export.py), or how ignis runs the MTP head at inference (ignis.backends.mtp).

MTP at position t (research/qwen35.md §5): u = fc(cat[pre_fc_norm_embedding(embed(x[t+1])), pre_fc_norm_hidden(h[t])])
with h the target's final hidden state after its final norm, then one full-attention decoder layer at position t,
then mtp.norm and the shared lm_head, which predicts x[t+2].
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

from tools.artifact.train_tokenizer import ENDOFTEXT_ID, IM_END_ID

# 39 MiB in bf16 with the MTP layer (target 18.5M parameters, MTP 2.0M), leaving ~25 MiB of the 64 MiB budget to
# the drafter. Embeddings are tied: an untied 8192 x 384 head would cost 6 MiB for little gain at this size, and
# Qwen3.5's small checkpoints tie too. GDN heads are 128 wide as in every Qwen3.5 checkpoint (fla's backward also
# miscompiles 64-wide keys on Hopper with Triton 3.4-3.7.0), and value heads pair two per key head (r = 2), as
# Qwen3-Next does, so the grouped path of every GDN implementation is exercised by the built-in model.
TARGET_SHAPE: dict[str, int] = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}

# Small enough to run a few CPU training steps in a test of the same code path.
TOY_SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def target_config(vocab_size: int, shape: dict[str, int], max_positions: int = 4096) -> Qwen3_5TextConfig:
    """The Qwen3.5 text config of the target: 3 Gated DeltaNet layers to 1 gated-attention layer, one MTP layer."""
    # mtp_num_hidden_layers is not a Qwen3_5TextConfig field: transformers keeps it as a plain attribute, and
    # readers of config.json (ignis, vLLM) take the MTP layer count from it.
    extra: dict[str, Any] = {"mtp_num_hidden_layers": 1, **shape}
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        # Qwen3.5's RoPE: partial (a quarter of each head), theta 1e7, interleaved M-RoPE whose three sections
        # coincide for text; the sections cover the 8 frequencies of a 16-dim rotary slice of a 64-dim head.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        pad_token_id=ENDOFTEXT_ID,
        bos_token_id=None,
        # <|im_end|> ends a chat turn, <|endoftext|> ends a raw completion: both stop generation.
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        architectures=["Qwen3_5ForCausalLM"],
        **extra,
    )


class MTPHead(nn.Module):
    """One MTP layer; attributes named so that `mtp.` + state_dict keys are the checkpoint's names."""

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        layer_config = copy.deepcopy(config)
        # The MTP layer is a full-attention decoder layer whatever the target's layer 0 is.
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    def forward(
        self,
        next_embeds: torch.Tensor,  # [B, T, H] float, embed(x[t+1]) for positions t = 0..T-1
        hidden: torch.Tensor,  # [B, T, H] float, target final hidden (after its norm) at positions t
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, T, rotary] for positions t
    ) -> torch.Tensor:  # [B, T, H] float, normed; the shared lm_head turns it into logits for x[t+2]
        # Embedding first, hidden second: the order the published MTP checkpoints use.
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # No mask: transformers' SDPA path is causal when the mask is None and there is no padding.
        u = self.layers[0](u, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(u)


def text_positions(batch: int, length: int, device: torch.device) -> torch.Tensor:  # [3, B, T] int64
    """Position ids in the M-RoPE layout transformers' Qwen3.5 rotary embedding takes (all three rows equal)."""
    return torch.arange(length, device=device).view(1, 1, -1).expand(3, batch, -1)


def losses(
    net: Qwen3_5ForCausalLM, mtp: MTPHead, seq: torch.Tensor  # [B, T+1] int64, device
) -> dict[str, torch.Tensor]:  # scalar float32 tensors, device
    """Next-token loss and MTP (token after next) loss over seq, with their top-1 accuracies.

    The target reads seq[:, :T] and predicts seq[:, 1:]; the MTP head at position t reads embed(seq[t+1]) and the
    target's hidden h[t] and predicts seq[t+2], for t = 0..T-2.
    """
    batch, length = seq.shape[0], seq.shape[1] - 1
    inner = net.model
    hidden = inner(input_ids=seq[:, :length], use_cache=False).last_hidden_state  # [B, T, H], after the final norm
    logits = net.lm_head(hidden)
    main_target = seq[:, 1:]
    main = nn.functional.cross_entropy(logits.float().flatten(0, 1), main_target.flatten())

    cos_sin = inner.rotary_emb(hidden, text_positions(batch, length - 1, seq.device))
    mtp_hidden = mtp(inner.embed_tokens(seq[:, 1:length]), hidden[:, : length - 1], cos_sin)
    mtp_logits = net.lm_head(mtp_hidden)
    mtp_target = seq[:, 2:]
    ahead = nn.functional.cross_entropy(mtp_logits.float().flatten(0, 1), mtp_target.flatten())
    with torch.no_grad():
        main_acc = (logits.argmax(-1) == main_target).float().mean()
        mtp_acc = (mtp_logits.argmax(-1) == mtp_target).float().mean()
    return {"loss": main, "mtp_loss": ahead, "acc": main_acc, "mtp_acc": mtp_acc}
