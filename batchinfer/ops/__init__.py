"""Operating the daemons: logging, Prometheus metrics, the health and metrics HTTP server."""
