"""Inter-process communication: msgspec wire messages over ZeroMQ, and the async EngineClient."""
