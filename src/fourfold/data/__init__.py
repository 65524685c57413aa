"""Data: tokenizers, `fourfold prepare`, the built-in corpus, and the rank-aware batch loader."""

from fourfold.data.builtin import builtin_corpus, check_data_path, resolve_data_path
from fourfold.data.errors import DataError
from fourfold.data.loader import Batch, BatchLoader, TokenDataset, documents, verify
from fourfold.data.manifest import Manifest
from fourfold.data.prepare import prepare, prepare_main
from fourfold.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["Batch", "BatchLoader", "ByteTokenizer", "DataError", "Manifest", "TokenDataset", "Tokenizer",
           "builtin_corpus", "check_data_path", "documents", "load_tokenizer", "prepare",
           "prepare_main", "resolve_data_path", "verify"]
