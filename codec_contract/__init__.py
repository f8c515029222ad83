"""The contract between the LLM tier and the SNAC codec tier, in one package both import.

- `api`: the gRPC stubs generated from proto/codec_contract/api/codec.proto.
- `audio`: what a frame is (7 codes, 2048 samples at 24 kHz), the policies, and how much audio a
  codec replica owes for the frames it was sent.
- `client`: channels, requests and a minimal Decode client.
"""
