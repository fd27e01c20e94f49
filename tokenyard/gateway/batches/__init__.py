"""Offline batch jobs: OpenAI's Files and Batches API, run as low-priority jobs on the queue.

A part of the gateway: the runner lives in the gateway process and submits through the
gateway's one admission path; its state is the broker's batch table.
"""
