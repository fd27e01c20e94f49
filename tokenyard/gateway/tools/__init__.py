"""Tool calling for the chat APIs: requests' tools and history (request.py), and the parsers
of a model's tool calls, whole or streamed (parsers.py). Pure: no I/O."""
