"""The wire format and the bus: messages, heartbeats, Redis key names, consumer groups,
reply-stream writes and the Redis URL forms every part shares."""
