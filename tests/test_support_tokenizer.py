"""The fast tests' SmolLM2 tokenizer (loaded without the weights) is the converted model's."""

from __future__ import annotations

from support.tokenizer import embedded_tokenizer, gguf_tokenizer

TEXTS = ["Hello there, world! 12345 caf\u00e9", "Task: A baker makes 12 muffins.\nFacts:", "<|im_start|>user\nHi<|im_end|>\n"]


def test_tokenizer_without_weights_is_the_models_tokenizer(smol):
    _, reference = smol
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    for tokenizer in (embedded_tokenizer(), gguf_tokenizer()):
        assert tokenizer.get_vocab() == reference.get_vocab()
        assert tokenizer.eos_token == reference.eos_token == "<|im_end|>"
        assert tokenizer.eos_token_id == reference.eos_token_id
        assert [tokenizer.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS]
        assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
