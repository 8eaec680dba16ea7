"""The run's directory and what it keeps: where a run lives and what running the same command
again does there, its one writer, its configuration, its files (written whole, read checked),
its final weights and FSDP's sharded checkpoints. The checkpoint format itself is a concept of
the course, ``nanolm/checkpoint.py``."""
