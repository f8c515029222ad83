"""The SNAC codec tier: Orpheus audio-code frames in, 24 kHz PCM out, micro-batched for many streams."""
