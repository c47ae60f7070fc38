"""The event loop's side: routes, request bodies, connections, streams,
metrics and the dashboard. Nothing here touches MLX; nothing below imports
this folder but `app.py`."""
