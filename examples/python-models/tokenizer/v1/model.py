"""A tokenizer step: each request's text (BYTES) in, its token ids (padded to MAX_TOKENS) and their count out.

The vocabulary is built here in code, so the step needs no download: a real one would load its tokenizer.json
from the version's folder (`context.version_dir`).
"""

import numpy as np
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel

import inferd

MAX_TOKENS = 16
WORDS = ["[PAD]", "[UNK]", "the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "and", "fast"]


class Model:
    def __init__(self) -> None:
        self.tokenizer = Tokenizer(WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="[UNK]"))
        self.tokenizer.normalizer = normalizers.Lowercase()
        self.tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding(length=MAX_TOKENS, pad_id=0)

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = []
        for text in inputs["text"][:, 0]:
            try:
                texts.append(text.decode())
            except UnicodeDecodeError as exc:  # this request alone is answered 400; the batch's others are not
                raise inferd.InvalidInput(f"the text is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        encodings = self.tokenizer.encode_batch(texts)
        return {
            "ids": np.array([encoding.ids for encoding in encodings], dtype=np.int64),
            "length": np.array([[sum(encoding.attention_mask)] for encoding in encodings], dtype=np.int64),
        }
