"""What the codec tier, the LLM tier and the front share besides the codec contract (codec_contract):
how settings are read from flags and the environment, and the HTTP/WebSocket shapes every door speaks.
It imports neither tier, so each tier and the front stand alone on it."""
