"""model=causal_lm: a Hugging Face transformers causal language model, built from its config class
with no download (GPT-2 124M by default; Llama-style sizes by knobs), or loaded from a directory
already on disk (`pretrained_path`: what `save_pretrained` writes).

Batches are `(tokens [B, T], next tokens [B, T])`, as data=tokens and data=hf_text serve them.
The forward runs the model's own modules in a plain loop (embeddings, the decoder layers, the
final norm, the head), without transformers' cache and mask machinery: the layers are the
repeated block list that recompute wraps, a pipeline cuts between and sharding shards, and
the loop traces into pipeline stages.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from typing_extensions import override

from runner.config.values import check_values
from runner.models import ClassifierModule, OptimizerFactory

FAMILIES = ("gpt2", "llama")


def hf_config(family: str, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int,
              n_kv_heads: Optional[int], ffn_dim: Optional[int], dropout: float, tie_embeddings: bool) -> Any:
    """The transformers config of `family` at these sizes, with torch's fused attention."""
    if family == "gpt2":
        from transformers import GPT2Config

        config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=d_model, n_layer=n_layers,
                            n_head=n_heads, n_inner=ffn_dim, resid_pdrop=dropout, embd_pdrop=dropout,
                            attn_pdrop=dropout, tie_word_embeddings=tie_embeddings, bos_token_id=None,
                            eos_token_id=None)
    else:
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq_len, hidden_size=d_model,
                             num_hidden_layers=n_layers, num_attention_heads=n_heads,
                             num_key_value_heads=n_kv_heads or n_heads, intermediate_size=ffn_dim or 4 * d_model,
                             attention_dropout=dropout, tie_word_embeddings=tie_embeddings, bos_token_id=None,
                             eos_token_id=None)
    config._attn_implementation = "sdpa"  # causal without a mask: the loop passes none
    return config


class CausalLM(ClassifierModule):
    """A transformers causal LM: tokens [B, T] (T <= seq_len) -> next-token logits [B, T, vocab_size].

    Defaults are nanoGPT's GPT-2 small (124M): vocabulary 50,304 (GPT-2's 50,257 padded to a
    multiple of 64), 1,024 positions, 12 layers of 768 with 12 heads, no dropout, the head tied
    to the token embedding. `family=llama` builds LlamaForCausalLM (RMSNorm, rotary positions,
    SwiGLU; `n_kv_heads` for grouped-query attention, `ffn_dim` the MLP's width).
    """

    def __init__(
        self,
        family: str = "gpt2",
        vocab_size: int = 50304,
        seq_len: int = 1024,
        d_model: int = 768,
        n_layers: int = 12,
        n_heads: int = 12,
        n_kv_heads: Optional[int] = None,
        ffn_dim: Optional[int] = None,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        pretrained_path: Optional[str] = None,
        optimizer: Optional[OptimizerFactory] = None,
        warmup_steps: int = 0,
        lr_decay: str = "cosine",
        min_lr_ratio: float = 0.1,
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"family={family}: must be one of {', '.join(FAMILIES)}")
        check_values(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model}: must be a multiple of n_heads={n_heads}")
        super().__init__(optimizer, warmup_steps, lr_decay, min_lr_ratio)
        from transformers import AutoModelForCausalLM

        if pretrained_path is None:
            config = hf_config(family, vocab_size, seq_len, d_model, n_layers, n_heads, n_kv_heads, ffn_dim, dropout,
                               tie_embeddings)
            self.lm = AutoModelForCausalLM.from_config(config)
        else:
            if not (Path(pretrained_path).expanduser() / "config.json").is_file():
                raise ValueError(f"pretrained_path={pretrained_path}: no config.json there (a directory that "
                                 f"save_pretrained wrote)")
            self.lm = AutoModelForCausalLM.from_pretrained(Path(pretrained_path).expanduser(), local_files_only=True,
                                                           attn_implementation="sdpa")
        config = self.lm.config
        self.family = "gpt2" if config.model_type == "gpt2" else "llama"
        self.vocab_size = config.vocab_size
        self.seq_len = config.n_positions if self.family == "gpt2" else config.max_position_embeddings
        decoder = self.decoder()
        # Training FLOPs per token (forward and backward), for model FLOPs utilisation: 6 per
        # weight a token meets (embedding lookups are free; a tied head's matmul is not) plus
        # attention's scores and weighted sums over the context (PaLM, appendix B).
        final_norm = decoder.ln_f if self.family == "gpt2" else decoder.norm
        weights = sum(p.numel() for part in (self.layers, final_norm, self.lm.lm_head) for p in part.parameters())
        hidden = config.hidden_size
        self.flops_per_token = 6 * weights + 12 * len(self.layers) * hidden * self.seq_len

    def decoder(self) -> nn.Module:
        """The model's decoder stack: GPT-2's `transformer`, Llama's `model`."""
        return self.lm.transformer if self.family == "gpt2" else self.lm.model

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers: the repeated block list (a property, not a second registration of them)."""
        return self.decoder().h if self.family == "gpt2" else self.decoder().layers

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """How tensor parallelism splits a Llama (torchtitan's plan without sequence parallelism):
        q, k, v and the MLP's gate and up projections by output features (whole heads per rank),
        the attention output and the MLP's down projection by input features. GPT-2's fused qkv
        projection is a transposed Conv1D that torch's styles cannot split."""
        if self.family == "gpt2":
            raise ValueError("family=gpt2: its fused q/k/v Conv1D layers cannot be split by torch's tensor-parallel "
                             "styles; use family=llama for tensor parallelism")
        return {"lm.model.layers.*.self_attn.q_proj": ColwiseParallel(),
                "lm.model.layers.*.self_attn.k_proj": ColwiseParallel(),
                "lm.model.layers.*.self_attn.v_proj": ColwiseParallel(),
                "lm.model.layers.*.self_attn.o_proj": RowwiseParallel(),
                "lm.model.layers.*.mlp.gate_proj": ColwiseParallel(), "lm.model.layers.*.mlp.up_proj": ColwiseParallel(),
                "lm.model.layers.*.mlp.down_proj": RowwiseParallel()}

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        decoder = self.decoder()
        positions = torch.arange(tokens.size(1), device=tokens.device)
        if self.family == "gpt2":
            x = decoder.drop(decoder.wte(tokens) + decoder.wpe(positions))
            for layer in self.layers:
                x = layer(x)
            return self.lm.lm_head(decoder.ln_f(x))
        x = decoder.embed_tokens(tokens)
        position_ids = positions.unsqueeze(0)
        rotary = decoder.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, position_embeddings=rotary, position_ids=position_ids)
        return self.lm.lm_head(decoder.norm(x))
