"""The front doors: eight TTS protocols over one speech session each.

openai.py (POST /v1/audio/speech), cartesia.py, deepgram.py, elevenlabs.py, baseten.py, together.py, vllm_omni.py
(vLLM-Omni's speech socket) and slng.py (SLNG's Unmute Bridge), each a router the app mounts; what they share is
here beside them, never in another door: http.py (a request body's text, whole-response speech, the trim, refusals
as errors) and sockets.py (one writer per socket, the message budget, a context's audio and its end).
"""
