"""The coordinator's HTTP server: the API (one small handler per endpoint, `app.py`), its
signature check and connection guard, the state thread every call into the book runs on
(`control.py`), waiting lease calls (`waiting.py`), metrics, latency figures and the API fronts."""
