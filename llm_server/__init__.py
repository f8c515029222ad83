"""The LLM tier: text in, Orpheus audio-code tokens out over vLLM, speech streamed over HTTP (to come)."""
