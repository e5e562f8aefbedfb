"""What the HTTP servers and clients of unirl share: the guards every server puts before its endpoints
(``guards``: token, body size and time, settings a client may not change), the server base (``server``:
uvicorn on a socket bound at once, served in a thread or the main one) and the retrying JSON client
(``client``). ``unirl serve-reward`` (``unirl/rewards/remote.py``), ``unirl serve-tool``
(``unirl/tools/remote.py``) and ``unirl serve-rollout`` (``unirl/rollout/server.py``) are built on them.
"""
