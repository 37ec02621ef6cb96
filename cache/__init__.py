"""The artifact store (installed as ``stitch_backend.cache``).

A small library of its own: it imports nothing from ``stitch_backend`` or
``stitch_backend.agents``; keys and manifests come in as plain values.
"""
