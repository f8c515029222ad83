"""The HTTP edge's guards, outermost first: request ids on every response and log line (request_ids.py; cutting a
response's connection on purpose is orpheus_common/connections.py, which the front uses too),
API keys (auth.py), the body size limit (body_limit.py), and the one client error the endpoints raise
(errors.py)."""
