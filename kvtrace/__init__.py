"""kvtrace: what did the KV cache do to my requests?"""
__version__ = "0.1.0"
