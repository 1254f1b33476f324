"""Triton kernels and their torch references (issue E). No ``__version__`` here on purpose:
transformers probes a top-level ``kernels`` package for one."""
