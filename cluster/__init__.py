"""Serving around the workers: Ray actors and Serve app, gRPC service and router, tracing and
metrics setup, and the `slidespec` command line."""
