"""Engines: one module per engine kind behind one interface (base.py), the registry, and vLLM helpers."""
