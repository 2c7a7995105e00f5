"""Adapters from other libraries' attention APIs to tritonattn's public API."""
