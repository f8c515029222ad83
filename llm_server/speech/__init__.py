"""One stream of speech, door-independent: session.py owns it (admission, segments in order, encoding,
cancellation, its events), stream.py generates it (engine tokens -> frames -> the codec's PCM), prompt.py
makes the engine's ids, segmenter.py cuts incoming text into segments, runaway.py ends a looping segment,
codec_client.py talks to the SNAC tier, encoding.py makes the client's format."""
