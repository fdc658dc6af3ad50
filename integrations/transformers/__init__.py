"""The transformers runtime: the reference executor (``executor``), the model's rotary parameters
and the RoPE self-check (``rotary``), the embedded SmolLM2 (``embedded``), a sentence embedder."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.transformers.executor": ("TransformersExecutor",),
    "kvcomm.integrations.transformers.rotary": ("rotary_from_model", "self_check", "SelfCheck"),
    "kvcomm.integrations.transformers.embedded": ("load_model_and_tokenizer", "load_tokenizer", "resolve_model_dir", "DTYPES"),
    "kvcomm.integrations.transformers.sentence_embedder": ("SentenceEmbedder",),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
