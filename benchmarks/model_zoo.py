"""The real models of the models suite (`benchmarks.models`): a registry, built from configs.

Every model is built from a config with random weights: nothing is downloaded (no
`from_pretrained`, no hub). A `ModelSpec` names the model, its family and the
library it needs; its builder takes `tiny` (a few-layer config for the CPU smoke
test) and returns a `Built`: the module, an input maker per batch size, the
forward that gives the logits and the training loss. Dropout is 0 everywhere, so
every backend computes the same function.

A spec whose library is missing is skipped by the harness with `missing()`'s line.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

Inputs = dict[str, torch.Tensor]
Family = Literal["llm", "encoder", "encoder-decoder", "cnn", "vision-transformer"]
Library = Literal["torch", "transformers", "timm"]


@dataclass(frozen=True)
class Built:
    model: torch.nn.Module
    make_inputs: Callable[[int, torch.device], Inputs]  # batch size, device -> inputs (fp32)
    forward: Callable[[torch.nn.Module, Inputs], torch.Tensor]  # the logits (or output)
    loss: Callable[[torch.nn.Module, Inputs], torch.Tensor]  # a scalar, for training
    shape: str  # what one sample is, for the table: "seq 512", "224x224"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: Family
    library: Library
    build: Callable[[bool], Built]
    infer_batch: int  # throughput batch of `infer` and `fp32` (full size)
    train_batch: int

    def missing(self) -> str | None:
        """Why this model cannot run here, or None."""
        if importlib.util.find_spec(self.library) is None:
            return f"needs {self.library}, which is not installed"
        return None


TINY_BATCH = 2


# --------------------------------------------------------------------------- transformers


def _token_inputs(vocab: int, seq: int, decoder: bool = False
                  ) -> Callable[[int, torch.device], Inputs]:
    def make(batch: int, device: torch.device) -> Inputs:
        ids = {"input_ids": torch.randint(vocab, (batch, seq), device=device)}
        if decoder:
            ids["decoder_input_ids"] = torch.randint(vocab, (batch, seq), device=device)
        return ids
    return make


def _logits(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
    return m(**x).logits


def no_cache(m: torch.nn.Module) -> dict[str, Any]:
    """`use_cache=False` for a model whose forward takes it (decoders; encoders such
    as BERT do not in every transformers version)."""
    takes = "use_cache" in inspect.signature(m.forward).parameters
    return {"use_cache": False} if takes else {}


def _lm_loss(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
    # a training step keeps no KV cache: with one, every layer's first `update` is a
    # guard Dynamo recompiles on, and a graph split into blocks hits its recompile limit
    return m(**x, labels=x["input_ids"], **no_cache(m)).loss


def _seq2seq_loss(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
    # labels make T5 build its own decoder inputs (labels shifted right)
    return m(input_ids=x["input_ids"], labels=x["decoder_input_ids"], **no_cache(m)).loss


def _hf_built(model: torch.nn.Module, vocab: int, seq: int, decoder: bool = False) -> Built:
    return Built(model=model, make_inputs=_token_inputs(vocab, seq, decoder), forward=_logits,
                 loss=_seq2seq_loss if decoder else _lm_loss, shape=f"seq {seq}")


def build_gpt2(tiny: bool) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128) if tiny else {}
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **size)
    return _hf_built(GPT2LMHeadModel(cfg), cfg.vocab_size, 32 if tiny else 512)


def build_bert(tiny: bool) -> Built:
    from transformers import BertConfig, BertForMaskedLM

    size = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                intermediate_size=256, vocab_size=1000, max_position_embeddings=128) if tiny else {}
    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **size)
    return _hf_built(BertForMaskedLM(cfg), cfg.vocab_size, 32 if tiny else 512)


def build_llama(tiny: bool, layers: int | None = None) -> Built:
    """Llama-style: RMSNorm, rotary, SwiGLU, grouped-query attention (4 kv heads of 16).
    `layers` overrides the config's depth (benchmarks/regional.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=176, vocab_size=1000,
                    max_position_embeddings=128)
    else:
        size = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, intermediate_size=2816, vocab_size=32000,
                    max_position_embeddings=2048)
    if layers is not None:
        size["num_hidden_layers"] = layers
    cfg = LlamaConfig(attention_dropout=0.0, **size)
    return _hf_built(LlamaForCausalLM(cfg), cfg.vocab_size, 32 if tiny else 512)


def build_t5_small(tiny: bool) -> Built:
    """t5-small's sizes, written out (the hub's config is not fetched)."""
    from transformers import T5Config, T5ForConditionalGeneration

    if tiny:
        size = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2,
                    num_heads=2, vocab_size=1000)
    else:
        size = dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                    num_heads=8, vocab_size=32128)
    cfg = T5Config(dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **size)
    return _hf_built(T5ForConditionalGeneration(cfg), cfg.vocab_size, 32 if tiny else 512,
                     decoder=True)


# --------------------------------------------------------------------------- timm


def _image_inputs(size: int, classes: int) -> Callable[[int, torch.device], Inputs]:
    def make(batch: int, device: torch.device) -> Inputs:
        return {"images": torch.randn(batch, 3, size, size, device=device),
                "labels": torch.randint(classes, (batch,), device=device)}
    return make


def _classify(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
    return m(x["images"])


def _cross_entropy(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
    return F.cross_entropy(m(x["images"]), x["labels"])


def _timm(name: str, size: int, tiny_name: str, tiny_size: int, tiny_kwargs: dict[str, Any]
          ) -> Callable[[bool], Built]:
    """A timm builder: `name` at `size`, or `tiny_name` with `tiny_kwargs` at `tiny_size`."""
    def build(tiny: bool) -> Built:
        import timm

        classes = 10 if tiny else 1000
        kwargs = dict(tiny_kwargs, num_classes=classes) if tiny else {}
        model = timm.create_model(tiny_name if tiny else name, pretrained=False,
                                  drop_rate=0.0, **kwargs)
        px = tiny_size if tiny else size
        return Built(model=model, make_inputs=_image_inputs(px, classes), forward=_classify,
                     loss=_cross_entropy, shape=f"{px}x{px}")
    return build


build_resnet50 = _timm("resnet50", 224, "resnet18", 32, {})
build_vit_b16 = _timm("vit_base_patch16_224", 224, "vit_base_patch16_224", 32,
                      dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2))
build_mobilenetv3 = _timm("mobilenetv3_large_100", 224, "mobilenetv3_small_050", 32, {})
build_swin_t = _timm("swin_tiny_patch4_window7_224", 224, "swin_tiny_patch4_window7_224", 64,
                     dict(img_size=64, window_size=4, embed_dim=32, depths=(1, 1, 1, 1),
                          num_heads=(1, 2, 4, 8)))


# --------------------------------------------------------------------------- torch


def build_torch_encoder(tiny: bool) -> Built:
    """torch's own nn.TransformerEncoder (batch_first); the loss is a mean square."""
    d_model, heads, layers, ff, seq = (32, 2, 2, 64, 16) if tiny else (512, 8, 6, 2048, 512)
    layer = torch.nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def make(batch: int, device: torch.device) -> Inputs:
        return {"src": torch.randn(batch, seq, d_model, device=device)}

    def forward(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
        return m(x["src"])

    def loss(m: torch.nn.Module, x: Inputs) -> torch.Tensor:
        return m(x["src"]).float().pow(2).mean()

    return Built(model=model, make_inputs=make, forward=forward, loss=loss, shape=f"seq {seq}")


MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("gpt2", "llm", "transformers", build_gpt2, infer_batch=16, train_batch=8),
    ModelSpec("bert", "encoder", "transformers", build_bert, infer_batch=16, train_batch=8),
    ModelSpec("llama", "llm", "transformers", build_llama, infer_batch=8, train_batch=4),
    ModelSpec("t5-small", "encoder-decoder", "transformers", build_t5_small, infer_batch=16,
              train_batch=8),
    ModelSpec("resnet50", "cnn", "timm", build_resnet50, infer_batch=32, train_batch=32),
    ModelSpec("vit_b16", "vision-transformer", "timm", build_vit_b16, infer_batch=32,
              train_batch=32),
    ModelSpec("mobilenetv3", "cnn", "timm", build_mobilenetv3, infer_batch=32, train_batch=32),
    ModelSpec("swin_t", "vision-transformer", "timm", build_swin_t, infer_batch=32,
              train_batch=32),
    ModelSpec("torch_encoder", "encoder", "torch", build_torch_encoder, infer_batch=16,
              train_batch=8),
)
BY_NAME = {m.name: m for m in MODELS}
