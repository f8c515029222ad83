"""The concurrency benchmark's parts: corpus, per-stream metrics, search, load, stack, report.

`benchmarks/concurrency.py` is the command; these modules are what it is built from, and
`metrics` and `search` are pure so tests can feed them synthetic timelines and verdicts.
"""
