"""Primitives: exact RoPE realignment (``rope``), the KV of a token span (``kv``), prompts as
segments (``segments``), layer blocks (``blocks``), KV heads split over ranks (``heads``), model fingerprints, the KL bound
(``divergence``) and file reading (``textfile``). torch and numpy only; imports nothing else of kvcomm."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.core.rope": ("Rotary", "RopeError"),
    "kvcomm.core.kv": ("KV", "to_position_free", "place", "positions"),
    "kvcomm.core.segments": ("Segment", "Prompt", "content_id"),
    "kvcomm.core.blocks": ("block_layers",),
    "kvcomm.core.heads": ("HeadShards", "ALL_HEADS", "ProcessGroupHeads"),
    "kvcomm.core.fingerprint": ("ModelFingerprint", "model_fingerprint"),
    "kvcomm.core.divergence": ("TopK", "topk_reference", "kl_topk_other", "top1_matches"),
    "kvcomm.core.textfile": ("read_utf8", "parse_json"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
