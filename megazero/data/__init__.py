"""Data pipeline: tokenizers, Megatron's ``.bin/.idx`` indexed dataset, GPT samples, samplers.

Nothing here imports torch at module level except ``samplers`` (for ``collate`` and the data
loader), so the preprocessing tools start fast.
"""
from megazero.data.gpt_dataset import (BlendedDataset, GPTDataset,
                                       build_train_valid_test_datasets, parse_data_path)
from megazero.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                           IndexedDatasetError)
from megazero.data.samplers import PretrainingSampler, build_pretraining_data_loader, collate
from megazero.data.tokenizers import (TOKENIZER_TYPES, GPT2BPETokenizer, GPTSentencePieceTokenizer,
                                      HuggingFaceTokenizer, Llama2Tokenizer, NullTokenizer,
                                      SentencePieceTokenizer, TokenizerConfig, build_tokenizer)

__all__ = [
    "BlendedDataset", "GPTDataset", "build_train_valid_test_datasets", "parse_data_path",
    "IndexedDataset", "IndexedDatasetBuilder", "IndexedDatasetError",
    "PretrainingSampler", "build_pretraining_data_loader", "collate",
    "GPT2BPETokenizer", "NullTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
    "Llama2Tokenizer", "HuggingFaceTokenizer", "TOKENIZER_TYPES", "TokenizerConfig", "build_tokenizer",
]
