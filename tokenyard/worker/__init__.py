"""Workers: claim jobs, run them through an engine, publish tokens, complete."""
