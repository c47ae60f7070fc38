"""Per-request CPU work done before a request is queued: its prompt (chat
template, checkpoints), its constraint (grammar, forced tool call) and
thinking budget, and the lanes that run that work off the event loop."""
