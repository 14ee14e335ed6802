"""`lightning.chat.TextCodec`: the Rust tokenizer called directly gives the ids and the text that transformers'
wrapper gives, special tokens, multi-byte characters and cut-off prefixes included; where the wrapper would change
the text afterwards, the codec goes through the wrapper."""

from __future__ import annotations

from lightning.chat import TextCodec
from lightning.models.tiny import build_tokenizer

TEXTS = [
    "",
    "hello world",
    "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>{"name": "lookup", "arguments": {"key": "j"}}</tool_call>',
    "naïve café, 東京 🙂",
    "  spaces   and\ttabs\n\n",
    "a" * 300,
]


def assert_same_as_the_wrapper(codec: TextCodec) -> None:
    tokenizer = codec.tokenizer
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids == tokenizer.encode(text, add_special_tokens=False), text
        for end in range(len(ids) + 1):  # as the engine decodes a row at every token: cut characters included
            assert codec.decode(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True), (text, end)


def test_the_rust_tokenizer_gives_the_wrappers_ids_and_text() -> None:
    codec = TextCodec(build_tokenizer())
    assert codec.backend is not None
    assert_same_as_the_wrapper(codec)


def test_special_tokens_split_as_the_tokenizer_says() -> None:
    tokenizer = build_tokenizer()
    tokenizer.split_special_tokens = True  # "<|im_end|>" in a text is then its characters, not the token
    codec = TextCodec(tokenizer)
    assert codec.encode("<|im_end|>") != [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert_same_as_the_wrapper(codec)


def test_a_tokenizer_that_tidies_spaces_goes_through_the_wrapper() -> None:
    tokenizer = build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    codec = TextCodec(tokenizer)
    assert codec.backend is None
    assert_same_as_the_wrapper(codec)
