"""tokenyard: LLM serving through a durable, distributed task queue."""

__version__ = "0.1.0"
