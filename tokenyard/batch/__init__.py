"""Offline batch jobs: OpenAI's Files and Batches API, run as low-priority jobs on the queue."""
