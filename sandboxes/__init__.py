"""Sandboxes for model-written code (issue B): backends, pool, service, client, verifiers.

This package imports nothing else of agentrl so it can run alone as a service.
"""
