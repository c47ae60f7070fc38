"""Wire protocols: request bodies in, validated requests and response frames
out. No I/O and no engine: each protocol translates into the one chat-shaped
request the planner and engine serve."""
