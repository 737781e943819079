"""Small Hugging Face tokenizer folders and models, written by ``transformers`` itself, for tests.

* ``llama_tokenizer(folder, texts)``: a byte-level BPE (vocabulary 500 with ``<s>``/``</s>``)
  whose post-processor puts ``<s>`` first, as Llama's does, saved by
  ``PreTrainedTokenizerFast.save_pretrained`` (tokenizer.json + tokenizer_config.json).
* ``gpt2_tokenizer(folder, texts)``: GPT-2 files (vocab.json / merges.txt from
  ``megazero.data.bpe_trainer``) saved by ``transformers.GPT2Tokenizer.save_pretrained``.
* ``llama_model`` / ``qwen2_model`` / ``gpt2_model``: random-weight models saved with ``save_pretrained``.
"""
from __future__ import annotations

import os

import torch


def llama_tokenizer(folder: str, texts: list[str], vocab_size: int = 500) -> str:
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return folder


def gpt2_tokenizer(folder: str, texts: list[str], num_merges: int = 300) -> str:
    import transformers

    from megazero.data.bpe_trainer import train_byte_level_bpe, write_gpt2_files

    os.makedirs(folder, exist_ok=True)
    vocab, merges = train_byte_level_bpe(texts, num_merges=num_merges)
    write_gpt2_files(vocab, merges, os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"))
    transformers.GPT2Tokenizer(os.path.join(folder, "vocab.json"),
                               os.path.join(folder, "merges.txt")).save_pretrained(folder)
    return folder


def llama_model(folder: str, vocab_size: int, seed: int = 0):
    """Llama with GQA (8 heads, 4 groups) and an untied head, random weights (std 0.3, so greedy
    choices are clear-cut), saved to ``folder``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                   initializer_range=0.3,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    return model


def qwen2_model(folder: str, vocab_size: int, seed: int = 0, tie: bool = True):
    """Qwen2 / Qwen2.5 (bias on q/k/v only, GQA 8 heads / 4 groups, rope_theta 1e6), the head tied
    as the small Qwen2.5 models (``tie``), random weights and QKV biases (std 0.3), saved to ``folder``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                   initializer_range=0.3, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1,
                                   pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    _randomize_norms(model)
    with torch.no_grad():  # HF initializes biases to zero: a wrong mapping of them would not show
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model


def gpt2_model(folder: str, vocab_size: int, seed: int = 0):
    """GPT-2 (tanh GELU, tied head), random weights (std 0.3), saved to ``folder``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                  initializer_range=0.3, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    return model


def _randomize_norms(model):
    """Norm weights/biases away from 1/0, so a wrong mapping of them shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith("ln_f.weight") or name.endswith("ln_f.bias"):
                p.add_(0.1 * torch.randn_like(p))
