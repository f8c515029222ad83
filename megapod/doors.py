"""The front doors `megapod say` speaks through: here alone, so the `megapod` command can name them without loading
the HTTP and WebSocket clients (the GPU node's kit has neither: tests/test_gpu_kit.py)."""

DOORS = ("openai", "cartesia", "deepgram", "elevenlabs", "baseten", "together", "vllm-omni", "slng")
