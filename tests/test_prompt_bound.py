"""What the engine reads off a tokenizer while it loads: the size bound on prompts (from the
pre-tokenizer, the normalizer and the longest token) and the ids that stop generation."""

from __future__ import annotations

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import Unigram

from astream.models.text_tokenizer import TextTokenizer, TokenizerSpec
from astream.text.tokenization import PromptBound, stop_token_ids


def unigram(normalizer) -> TextTokenizer:
    tok = Tokenizer(Unigram([("<unk>", 0.0), ("\u2581hello", -1.0), ("é", -2.0), ("<0x41>", -3.0)], 0))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return TextTokenizer(tok, TokenizerSpec(unk_token="<unk>"))


def test_byte_level_bound_and_stop_ids(smollm2_tokenizer):
    assert PromptBound.of(smollm2_tokenizer) == PromptBound(81, 1)
    vocab = smollm2_tokenizer.get_vocab()
    assert max(map(len, vocab)) == 81
    assert stop_token_ids(smollm2_tokenizer, [7]) == (0, 2, 7)       # <|endoftext|>, <|im_end|>


def test_other_tokenizers_count_utf8_bytes_and_normalizer_shrink():
    nfkc_lower = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert PromptBound.of(unigram(nfkc_lower)) == PromptBound(len("\u2581hello".replace("\u2581", " ")), 9)
    assert PromptBound.of(unigram(None)) == PromptBound(6, 1)
    assert PromptBound.of(unigram(normalizers.Strip())).shrink == 0    # may delete text: no bound
    assert stop_token_ids(unigram(None), [3]) == (3,)
