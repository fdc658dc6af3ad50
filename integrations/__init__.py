"""Runtimes and front ends on top of the core: ``transformers``, ``vllm`` (the plugin), ``serve``,
``chat`` with ``autogen``, ``ag2`` and ``remote``; the ``kvcomm`` command (``cli``) and its demo (``demo``)."""
