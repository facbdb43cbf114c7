"""The checkpoint's own tokenizer: HF tokenizer files, or the one embedded in a GGUF file."""

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minivllm.logger import init_logger
from minivllm.transformers_utils.config import is_gguf

logger = init_logger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def get_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer; a folder without tokenizer files gives None (token-id prompts only)."""
    if is_gguf(path):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path))
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("No tokenizer files in %s: only token-id prompts will work.", path)
        return None
    return AutoTokenizer.from_pretrained(path)
