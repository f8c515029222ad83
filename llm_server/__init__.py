"""The LLM tier: text in over eight front doors, Orpheus audio-code tokens out of vLLM, decoded by the SNAC tier,
speech streamed back.

In rooms along a request's path: edge/ (request ids, keys, body limit: the HTTP edge's guards), doors/ (the eight
protocols and what they share), speech/ (one stream: its session, generation, prompt, segments, codec client,
encoding), engine/ (the backbone behind one interface: vLLM, TensorRT-LLM, the frame constraint). At the top: the
worker's shell (server.py, api.py, runtime.py, config.py, metrics.py), its voices (voices.py, clones.py,
reference_audio.py), admission and capacity, and the doctor's self-check (selfcheck.py).
"""
