"""The data before it becomes batches: documents read from files, the built-in corpus of known
entropy, public corpora downloaded and verified, and the preparation that tokenizes them once
into token shards. Cutting the shards into training windows is a concept of the course,
``nanolm/batches.py``."""
