"""The MegaPod's front: one endpoint before the LLM workers, relaying every front door to the worker with the
most free capacity it reported (then one with the voice already loaded, then the fewest active streams). Its own
component: it imports neither tier (only orpheus_common) and runs from its own slim image
(deploy/docker/front.Dockerfile: no torch, no vLLM)."""
